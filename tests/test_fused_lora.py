"""Fused LoRA (`patching/fused_lora.py`): peft's LoRA linears with the adapter's product added by
its GEMM, against independent references: the fp64 product `x·Wᵀ + b + s·(x·Aᵀ)·Bᵀ` and its
gradients, and stock peft's forward on the same model.

Tolerances: fp32 against fp64 1e-6 (fp32 accumulation over K <= 64); a whole fp32 model against peft
1e-5 (the adapter's product is added inside the GEMM, before its own rounding: measured 7e-7 on the
gradients); under bf16 autocast, no farther from the fp32 run than peft's own bf16 (x1.25).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from axolotl_fastqwen import patch_model, unpatch_model
from axolotl_fastqwen.patching import fp8_weights, lora_weight_copies
from axolotl_fastqwen.patching.fused_lora import KEY, add_adapter
from op_count import OpCount
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


# ---- the adapters cast once a forward (`patching/lora_weight_copies.py`) ------------------------------

def _bf16_model(family="qwen3_5", gc=None, alpha=8):
    """peft's defaults under the Trainer's `bf16: true`: the base in bf16, the adapters in fp32."""
    from peft import LoraConfig, get_peft_model
    from test_patching import LORA_TARGETS, model_for

    torch.manual_seed(0)
    model = get_peft_model(model_for(family), LoraConfig(r=4, lora_alpha=alpha, target_modules=LORA_TARGETS,
                                                         init_lora_weights=False))
    if gc is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": gc})
    model = model.to(torch.bfloat16)
    for name, p in model.named_parameters():
        if "lora_" in name:
            p.data = p.data.float()
    return model


def _autocast_step(model, batch, copies: bool, monkeypatch, count: bool = False):
    """One forward and backward under bf16 autocast: (loss, grads, the fused-LoRA report, op counts)."""
    with monkeypatch.context() as m:
        if not copies:
            m.setattr(lora_weight_copies.LoraWeightCopies, "_why_not", lambda self, device_type: "off: the test's control")
        report = patch_model(model, fused_cross_entropy=False, log=False)
        model.zero_grad(set_to_none=True)
        counter = OpCount() if count else contextlib.nullcontext()
        with torch.autocast("cpu", dtype=torch.bfloat16), counter:
            loss = model(**batch).loss
            loss.backward()
        fused = report.to_dict()["fused_lora"]
        text = report.format()
        unpatch_model(model)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, fused, text, (counter.counts if count else None)


@pytest.mark.parametrize("family,gc", [("qwen3_5", None), ("qwen3_5", False), ("qwen3_5", True), ("qwen3_5_moe", False)])
def test_adapters_cast_once_a_forward_give_the_per_layer_casts_bits(family, gc, monkeypatch):
    """lora_alpha = 2r (s = 2): s·B rounds to bf16 exactly as B does, so the loss and every gradient are
    the per-layer casts' bit for bit, without gradient checkpointing and under both of its forms
    (reentrant: the copies' backward runs once a recomputed layer)."""
    model = _bf16_model(family, gc)
    batch = packed_batch(sequences(model.config.vocab_size, [40, 31, 57]))
    ref_loss, ref, off, _, _ = _autocast_step(model, batch, False, monkeypatch)
    loss, grads, fused, text, _ = _autocast_step(model, batch, True, monkeypatch)
    layers = [m for m in model.modules() if type(m) is peft.tuners.lora.layer.Linear]
    assert off["weight_copies"]["state"] == "off: the test's control"
    assert fused["weight_copies"]["state"] == "on" and fused["weight_copies"]["layers"] == len(layers) > 0
    assert fused["fused_calls"] == off["fused_calls"] and not fused["peft_calls"]
    assert "cast to the compute dtype once a forward" in text
    assert torch.equal(loss, ref_loss) and set(grads) == set(ref)
    for name in ref:
        assert grads[name].dtype == torch.float32  # the adapters' own dtype
        assert torch.equal(grads[name], ref[name]), name


def test_adapters_cast_once_a_forward_launch_six_fewer_ops_a_layer(monkeypatch):
    """The claim itself, counted at the dispatcher: per fused layer 2 weight casts forward, their 2
    gradient casts and the 2 alpha multiplies of the addmm's backward are gone; the copies cost a few
    multi-tensor ops for all layers together."""
    model = _bf16_model()
    batch = packed_batch(sequences(model.config.vocab_size, [40, 31, 57]))
    *_, before = _autocast_step(model, batch, False, monkeypatch, count=True)
    *_, fused, _, after = _autocast_step(model, batch, True, monkeypatch, count=True)
    layers = fused["weight_copies"]["layers"]
    assert before["_to_copy"] - after["_to_copy"] == 4 * layers
    assert before["mul"] - after["mul"] == 2 * layers
    foreach = sum(n for op, n in after.items() if op.startswith("_foreach"))
    assert foreach <= 4 and after["empty"] <= 2 * layers + 8  # the grads' fp32 buffers, one stacked buffer a shape


def test_adapters_cast_once_a_forward_with_an_odd_scaling_are_as_accurate_per_layer():
    """s = 7/4: s·B is rounded once to bf16 where the per-layer path rounds B and scales in the GEMM's
    fp32 epilogue (the same error statistics), and the gradients lose a rounding (the per-layer path
    rounds the product, then its scaled value). Measured against fp64 on one layer, averaged over 24
    draws: no farther than the per-layer path (x1.05 for the draws' spread; measured 1.00 on the output
    and 0.85-0.94 on the gradients). The adapters are drawn in fp32, as they are after the first
    optimizer step: values that are bf16 already (peft's fresh `A`, cast up from the base's dtype) cast
    without error while `s·B` would not, and `B` starts at zero. A whole toy model is no judge here: its
    bf16 LoRA gradients are 10-30% from fp32 and any change of rounding moves that by up to half."""
    from axolotl_fastqwen.patching.lora_weight_copies import CastForCompute

    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    errors = {k: [0.0, 0.0] for k in ("y", "dx", "dA", "dB")}
    for _ in range(24):
        model = peft.get_peft_model(torch.nn.ModuleDict({"proj": torch.nn.Linear(256, 192, bias=False)}),
                                    peft.LoraConfig(r=8, lora_alpha=14, target_modules=["proj"], init_lora_weights=False))
        layer = model.base_model.model["proj"]
        layer.base_layer.to(torch.bfloat16)  # adapters drawn in fp32: not bf16 values already (as after a step)
        a, b, s = layer.lora_A["default"].weight, layer.lora_B["default"].weight, layer.scaling["default"]
        x = torch.randn(64, 256, generator=gen).bfloat16()
        dy = torch.randn(64, 192, generator=gen).bfloat16()
        ref = [t.detach().double().requires_grad_(True) for t in (x, a, b)]
        y_ref = ref[0] @ layer.base_layer.weight.double().t() + s * (ref[0] @ ref[1].t()) @ ref[2].t()
        y_ref.backward(dy.double())
        for k, copies in enumerate((False, True)):
            a.grad = b.grad = None
            xx = x.clone().requires_grad_(True)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                cast = CastForCompute.apply((torch.bfloat16,) * 2, (1.0, s), a, b) if copies else None
                y = add_adapter(layer, "default", xx, cast)
            y.backward(dy)
            for name, got, want in (("y", y, y_ref), ("dx", xx.grad, ref[0].grad), ("dA", a.grad, ref[1].grad),
                                    ("dB", b.grad, ref[2].grad)):
                errors[name][k] += rel(got, want) / 24
    assert s == 1.75
    for name, (per_layer, copies) in errors.items():
        assert copies <= 1.05 * per_layer, (name, errors)


def test_a_copy_is_never_read_after_its_weights_changed(monkeypatch):
    """The optimizer's step bumps the adapters' version counters: a layer called after it (outside the
    decoder's forward, which would cast again) multiplies its own weights, not the stale copy."""
    model = _bf16_model()
    batch = packed_batch(sequences(model.config.vocab_size, [40, 31]))
    report = patch_model(model, fused_cross_entropy=False, log=False)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(**batch).loss.backward()
        copies = report.fused_lora.copies
        layer = next(m for m in report.fused_lora.decoder_layers)
        a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
        assert copies.get(layer, "default", torch.bfloat16, a, b) is not None
        torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=10.0).step()
        assert copies.get(layer, "default", torch.bfloat16, a, b) is None
        x = torch.randn(3, layer.in_features, dtype=torch.bfloat16)
        with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
            got = layer(x)
            a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
            want = layer.base_layer(x) + layer.scaling["default"] * (x @ a.t().bfloat16()) @ b.t().bfloat16()
        assert rel(got, want) <= 1e-2  # bf16 rounding of the product; the stale copy is ~100% off
    finally:
        unpatch_model(model)


def test_adapters_outside_the_decoder_keep_their_own_cast(monkeypatch):
    """lm_head's adapter runs after the decoder and a vision tower's before it: the copies cover the
    decoders' layers only; lm_head's LoRA still runs fused, on its own weights."""
    from peft import LoraConfig, get_peft_model
    from test_patching import LORA_TARGETS, model_for

    torch.manual_seed(0)
    model = get_peft_model(model_for("qwen3_5"), LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS + ["lm_head"],
                                                            init_lora_weights=False)).to(torch.bfloat16)
    for name, p in model.named_parameters():
        if "lora_" in name:
            p.data = p.data.float()
    batch = packed_batch(sequences(model.config.vocab_size, [40, 31]))
    report = patch_model(model, fused_cross_entropy=False, log=False)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(**batch).loss.backward()
        fused = report.to_dict()["fused_lora"]
        head = model.get_base_model().lm_head
        assert fused["weight_copies"]["layers"] == fused["layers"] - 1
        assert id(head) not in report.fused_lora.copies.copies
        assert head.lora_A["default"].weight.grad is not None and fused["fused_calls"] == fused["layers"]
    finally:
        unpatch_model(model)


def test_adapters_cast_once_a_forward_is_off_with_several_processes(monkeypatch):
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda *a, **k: 2)
    model = _bf16_model()
    batch = packed_batch(sequences(model.config.vocab_size, [40, 31]))
    loss, grads, fused, text, _ = _autocast_step(model, batch, True, monkeypatch)
    assert fused["weight_copies"]["state"].startswith("off: several processes") and grads
    assert "adapter casts per layer: several processes" in text
