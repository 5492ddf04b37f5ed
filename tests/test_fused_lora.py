"""Fused LoRA (`patching/fused_lora.py`): peft's LoRA linears with the adapter's product added by
its GEMM, against independent references: the fp64 product `x·Wᵀ + b + s·(x·Aᵀ)·Bᵀ` and its
gradients, and stock peft's forward on the same model.

Tolerances: fp32 against fp64 1e-6 (fp32 accumulation over K <= 64); a whole fp32 model against peft
1e-5 (the adapter's product is added inside the GEMM, before its own rounding: measured 7e-7 on the
gradients); under bf16 autocast, no farther from the fp32 run than peft's own bf16 (x1.25).
"""

from __future__ import annotations

import pytest
import torch

from axolotl_fastqwen import patch_model, unpatch_model
from axolotl_fastqwen.patching import fp8_weights
from axolotl_fastqwen.patching.fused_lora import KEY, add_adapter
from test_lean_activations import lora_model
from test_patching import packed_batch, sequences

peft = pytest.importorskip("peft")


def rel(a, b):
    return float((a.detach().double() - b.detach().double()).norm() / b.detach().double().norm())


@pytest.mark.parametrize("bias", [True, False])
def test_the_adapter_added_by_the_gemm_is_the_product_and_its_gradients(bias):
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = peft.get_peft_model(torch.nn.ModuleDict({"proj": torch.nn.Linear(48, 40, bias=bias)}),
                                peft.LoraConfig(r=5, lora_alpha=7, target_modules=["proj"], init_lora_weights=False))
    layer = model.base_model.model["proj"]
    assert type(layer) is peft.tuners.lora.layer.Linear and not layer.base_layer.weight.requires_grad
    x = torch.randn(2, 7, 48, generator=gen, requires_grad=True)
    dy = torch.randn(2, 7, 40, generator=gen)
    y = add_adapter(layer, "default", x)
    y.backward(dy)
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    w, s = layer.base_layer.weight.double(), layer.scaling["default"]
    ref = [t.detach().double().requires_grad_(True) for t in (x, a, b)]
    y_ref = ref[0] @ w.t() + s * (ref[0] @ ref[1].t()) @ ref[2].t()
    if bias:
        y_ref = y_ref + layer.base_layer.bias.double()
    y_ref.backward(dy.double())
    assert rel(y, y_ref) <= 1e-6
    for got, want in zip((x, a, b), ref):
        assert rel(got.grad, want.grad) <= 1e-6


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


def test_lora_dropout_is_applied_to_the_adapters_input_with_peft_s_mask():
    """Axolotl's YAMLs often set lora_dropout: 0.05: the adapter's input is dropped out as peft drops it,
    one draw per call in peft's order, so the same seed gives peft's loss and gradients."""
    model = lora_model("qwen3_5", gc=False)
    for module in model.modules():
        if type(module).__name__ == "Linear" and hasattr(module, "lora_dropout"):
            module.lora_dropout["default"] = torch.nn.Dropout(0.3)
    batch = packed_batch(sequences(model.config.vocab_size, [40, 31, 57]))
    results = []
    for fused in (False, True):
        report = patch_model(model, fused_cross_entropy=False, fused_lora=fused, log=False)
        torch.manual_seed(5)
        results.append(_loss_and_grads(model, batch))
        if fused:
            assert report.to_dict()["fused_lora"]["fused_calls"] > 0 and not report.to_dict()["fused_lora"]["peft_calls"]
        unpatch_model(model)
    (ref_loss, ref), (loss, grads) = results
    assert rel(loss, ref_loss) <= 1e-5 and max(rel(grads[n], ref[n]) for n in ref) <= 1e-5
    torch.manual_seed(6)  # another draw: another loss (the control: dropout is on)
    patch_model(model, fused_cross_entropy=False, log=False)
    assert rel(_loss_and_grads(model, batch)[0], ref_loss) > 1e-4
    unpatch_model(model)


def test_what_is_not_the_plain_case_runs_peft_s_forward_and_the_report_says_why():
    model = lora_model("qwen3_5", gc=False)
    layer = model.get_base_model().model.layers[0]
    module = next(m for m in layer.modules() if type(m).__name__ == "Linear" and hasattr(m, "lora_A"))
    module.use_dora["default"] = True  # a variant the fused form does not compute (flag only: peft's path is not run)
    batch = packed_batch(sequences(model.config.vocab_size, [40, 31]))
    report = patch_model(model, fused_cross_entropy=False, log=False)
    try:
        with model.disable_adapter():
            model(**batch)
        peft_calls = report.to_dict()["fused_lora"]["peft_calls"]
        assert peft_calls["adapters disabled or merged"] == report.to_dict()["fused_lora"]["layers"]
        assert module.__dict__["forward"]._plain(torch.zeros(1, 4), (), {}) == (
            None, "a LoRA variant (DoRA, ...), lora_bias or fan_in_fan_out")
    finally:
        module.use_dora["default"] = False
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
        upcast_notes = [n for n in report.to_dict()["notes"] if "input upcast" in n]
        if fused:
            assert report.to_dict()["fused_lora"]["fused_calls"] > 0
            assert all(g.dtype == torch.float32 for g in grads.values())  # the adapters' own dtype
            assert not upcast_notes  # every layer runs fused, which never upcasts: nothing to claim
        else:
            assert len(upcast_notes) == 1 and "peft LoRA layers skip" in upcast_notes[0], upcast_notes
        unpatch_model(model)
        flat = torch.cat([grads[n].flatten() for n in fp32])
        errors[fused] = (rel(loss, fp32_loss), rel(flat, torch.cat([fp32[n].flatten() for n in fp32])))
    assert errors[True][0] <= 2e-2 and errors[False][0] <= 2e-2, errors
    assert errors[True][1] <= 1.25 * errors[False][1], errors


def test_fp8_and_fused_lora_compose(monkeypatch):
    """`fastqwen_fp8` under fused LoRA: the fused layers call their FP8 base (its forward counted), at the
    loss of the FP8 run on peft's forward and as far from the fp32 run as it on the gradients. Not closer
    to it than that: the two round the adapter's product differently (fp32 here: ~1e-7), and each
    layer's e4m3 rounding of its input and of dy turns such differences into whole e4m3 steps in some
    elements, as any perturbation would."""
    monkeypatch.setattr(fp8_weights, "MIN_FEATURES", 64)
    model = lora_model("qwen3_5", gc=False)
    batch = packed_batch(sequences(model.config.vocab_size, [40, 31, 57]))
    patch_model(model, fused_cross_entropy=False, log=False)
    _, fp32 = _loss_and_grads(model, batch)
    unpatch_model(model)
    results, calls = [], []
    for fused in (False, True):
        report = patch_model(model, fused_cross_entropy=False, fp8=True, fp8_tokens=64, fused_lora=fused, log=False)
        bases = [m for m in report.fp8.modules.values()]
        handles = [m.register_forward_hook(lambda *_: calls.append(fused)) for m in bases]
        results.append(_loss_and_grads(model, batch))
        for handle in handles:
            handle.remove()
        if fused:
            assert report.to_dict()["fused_lora"]["fused_calls"] > 0
        unpatch_model(model)
    assert calls.count(True) == calls.count(False) > 0  # the fused layers ran every FP8 base, as peft's do
    (ref_loss, ref), (loss, grads) = results
    assert rel(loss, ref_loss) <= 1e-5

    def distance(g):
        return rel(torch.cat([g[n].flatten() for n in fp32]), torch.cat([fp32[n].flatten() for n in fp32]))

    assert distance(grads) <= 1.25 * distance(ref)
