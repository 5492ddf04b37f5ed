"""The fused LoRA linear (`ops/lora_linear.py`) and its install on peft's LoRA layers
(`patching/fused_lora.py`), against independent references: the fp64 product
`x·Wᵀ + b + s·(x·Aᵀ)·Bᵀ` and its gradients, and stock peft's forward on the same model.

Tolerances: fp32 against fp64 1e-6 (fp32 accumulation over K <= 256); a whole fp32 model against peft
1e-5 (the adapter's product is added inside the GEMM, before its own rounding: measured 7e-7 on the
gradients); bf16 autocast against peft's bf16 2e-2 (bf16's 8 bits: each of peft's three roundings of
the adapter's product is one the fused form skips).
"""

from __future__ import annotations

import pytest
import torch

from axolotl_fastqwen import patch_model, unpatch_model
from axolotl_fastqwen.ops.lora_linear import DenseBase, Fp8Base, lora_linear
from axolotl_fastqwen.patching import fp8_weights
from axolotl_fastqwen.patching.fused_lora import KEY
from test_lean_activations import lora_model
from test_patching import packed_batch, sequences

peft = pytest.importorskip("peft")


def rel(a, b):
    return float((a.detach().double() - b.detach().double()).norm() / b.detach().double().norm())


def _operands(seed=0, shape=(2, 7, 48), out=40, rank=5, bias=True):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=gen)
    w = torch.randn(out, shape[-1], generator=gen)
    b = torch.randn(out, generator=gen) if bias else None
    a = torch.randn(rank, shape[-1], generator=gen)
    bb = torch.randn(out, rank, generator=gen)
    dy = torch.randn(*shape[:-1], out, generator=gen)
    return x, w, b, a, bb, dy


@pytest.mark.parametrize("bias", [True, False])
def test_lora_linear_is_the_product_and_its_gradients(bias):
    x, w, b, a, bb, dy = _operands(bias=bias)
    s = 0.7
    leaves = [t.clone().requires_grad_(True) for t in (x, a, bb)]
    y = lora_linear(leaves[0], leaves[1], leaves[2], DenseBase(w, b), s, torch.float32)
    y.backward(dy)
    ref = [t.double().requires_grad_(True) for t in (x, a, bb)]
    y_ref = ref[0] @ w.double().t() + s * (ref[0] @ ref[1].t()) @ ref[2].t()
    if b is not None:
        y_ref = y_ref + b.double()
    y_ref.backward(dy.double())
    assert rel(y, y_ref) <= 1e-6
    for got, want in zip(leaves, ref):
        assert rel(got.grad, want.grad) <= 1e-6


def test_an_input_without_gradient_still_trains_the_adapter():
    x, w, b, a, bb, dy = _operands()
    a, bb = a.requires_grad_(True), bb.requires_grad_(True)
    lora_linear(x, a, bb, DenseBase(w, b), 2.0, torch.float32).backward(dy)
    x2 = x.reshape(-1, x.shape[-1]).double()
    assert rel(bb.grad, 2.0 * dy.reshape(-1, 40).double().t() @ (x2 @ a.detach().double().t())) <= 1e-6
    assert a.grad is not None and a.grad.abs().sum() > 0


def test_fp8_base_runs_its_own_gemms_under_the_fused_adapter():
    """With an FP8 base the forward and input gradient are the FP8 ones (`ops/fp8_linear.py`): the
    fused output minus the adapter's product is the FP8 projection's output exactly."""
    from axolotl_fastqwen.ops.fp8_linear import Fp8Weight, fp8_linear

    x, w, _, a, bb, dy = _operands(shape=(3, 16, 64), out=32)
    fp8 = Fp8Weight.quantize(w)
    xl = x.clone().requires_grad_(True)
    y = lora_linear(xl, a, bb, Fp8Base(fp8, None, "fp8"), 0.5, torch.float32)
    y.backward(dy)
    xr = x.clone().requires_grad_(True)
    base = fp8_linear(xr, fp8)
    adapter = 0.5 * (xr @ a.t()) @ bb.t()
    (base + adapter).backward(dy)
    assert rel(y, base + adapter) <= 1e-6 and rel(xl.grad, xr.grad) <= 1e-6


def _loss_and_grads(model, batch):
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_a_patched_lora_model_runs_every_adapted_linear_fused_at_peft_s_losses_and_gradients(family):
    model = lora_model(family, gc=False)
    batch = packed_batch(sequences(model.config.vocab_size, [40, 31, 57]))
    patch_model(model, fused_cross_entropy=False, fused_lora=False, log=False)
    ref_loss, ref = _loss_and_grads(model, batch)  # peft's own forward
    unpatch_model(model)

    report = patch_model(model, fused_cross_entropy=False, log=False)
    loss, grads = _loss_and_grads(model, batch)
    fused = report.to_dict()["fused_lora"]
    layers = [m for m in model.modules() if type(m).__name__ == "Linear" and hasattr(m, "lora_A")]
    assert fused["layers"] == len(layers) > 0 and fused["fused_calls"] == len(layers) and not fused["peft_calls"]
    assert "fused LoRA" in report.format()
    assert rel(loss, ref_loss) <= 1e-5 and set(grads) == set(ref)
    worst = max(rel(grads[n], ref[n]) for n in ref)
    assert worst <= 1e-5, worst
    unpatch_model(model)
    assert not any(KEY in m.__dict__ or "forward" in m.__dict__ for m in layers)  # peft's forward again


def test_what_is_not_the_plain_case_runs_peft_s_forward_and_the_report_says_why():
    model = lora_model("qwen3_5", gc=False)
    layer = model.get_base_model().model.layers[0]
    module = next(m for m in layer.modules() if type(m).__name__ == "Linear" and hasattr(m, "lora_A"))
    module.lora_dropout["default"] = torch.nn.Dropout(0.1)
    batch = packed_batch(sequences(model.config.vocab_size, [40, 31]))
    report = patch_model(model, fused_cross_entropy=False, log=False)
    try:
        with model.disable_adapter():
            model(**batch)
        model(**batch)
        peft_calls = report.to_dict()["fused_lora"]["peft_calls"]
        assert peft_calls["lora_dropout > 0"] == 1
        assert peft_calls["adapters disabled or merged"] == report.to_dict()["fused_lora"]["layers"]
    finally:
        unpatch_model(model)


def test_under_bf16_autocast_the_fused_layers_are_as_close_to_fp32_as_peft_s_bf16():
    """At toy size with random weights the LoRA gradients are ill-conditioned in bf16 (peft's own bf16
    run is ~20% from fp32 on them): the fused run is held to peft's distance from the fp32 run, not to
    peft's bits."""
    import copy

    model = lora_model("qwen3_5", gc=False)
    batch = packed_batch(sequences(model.config.vocab_size, [40, 31, 57]))
    patch_model(model, fused_cross_entropy=False, log=False)
    fp32_loss, fp32 = _loss_and_grads(model, batch)
    unpatch_model(model)
    model = copy.deepcopy(model).to(torch.bfloat16)
    for name, p in model.named_parameters():
        if "lora_" in name:
            p.data = p.data.float()  # peft's default: adapters in fp32, the base in bf16, the Trainer's autocast
    errors = {}
    for fused in (False, True):
        report = patch_model(model, fused_cross_entropy=False, fused_lora=fused, log=False)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, grads = _loss_and_grads(model, batch)
        if fused:
            assert report.to_dict()["fused_lora"]["fused_calls"] > 0
            assert all(g.dtype == torch.float32 for g in grads.values())  # the adapters' own dtype
        unpatch_model(model)
        flat = torch.cat([grads[n].flatten() for n in fp32])
        errors[fused] = (rel(loss, fp32_loss), rel(flat, torch.cat([fp32[n].flatten() for n in fp32])))
    assert errors[True][0] <= 2e-2 and errors[False][0] <= 2e-2, errors
    assert errors[True][1] <= 1.25 * errors[False][1], errors


def test_fp8_and_fused_lora_compose(monkeypatch):
    """`fastqwen_fp8` under fused LoRA: the fused layers run the FP8 base (its GEMM counted), at the loss
    of the FP8 run on peft's forward and as far from the fp32 run as it on the gradients. Not closer to
    it than that: the two sum the layer's input gradients in another order (1e-7 apart in the last
    layer), and each earlier layer's e4m3 rounding of dy turns such differences into whole e4m3 steps
    (measured 2.8% at the first of four layers), as any perturbation would."""
    from axolotl_fastqwen.ops import lora_linear as op

    monkeypatch.setattr(fp8_weights, "MIN_FEATURES", 64)
    calls = []
    forward_rows = op.forward_rows
    monkeypatch.setattr(op, "forward_rows", lambda *a, **k: calls.append(1) or forward_rows(*a, **k))
    model = lora_model("qwen3_5", gc=False)
    batch = packed_batch(sequences(model.config.vocab_size, [40, 31, 57]))
    patch_model(model, fused_cross_entropy=False, log=False)
    _, fp32 = _loss_and_grads(model, batch)
    unpatch_model(model)
    results = []
    for fused in (False, True):
        patch_model(model, fused_cross_entropy=False, fp8=True, fp8_tokens=64, fused_lora=fused, log=False)
        results.append(_loss_and_grads(model, batch))
        unpatch_model(model)
    assert calls  # the fused layers ran the FP8 base's GEMM
    (ref_loss, ref), (loss, grads) = results
    assert rel(loss, ref_loss) <= 1e-5
    last = max(int(n.split("layers.")[1].split(".")[0]) for n in ref if "layers." in n)
    assert max(rel(grads[n], ref[n]) for n in ref if f"layers.{last}." in n) <= 1e-5

    def distance(g):
        return rel(torch.cat([g[n].flatten() for n in fp32]), torch.cat([fp32[n].flatten() for n in fp32]))

    assert distance(grads) <= 1.25 * distance(ref)
