"""The dense SwiGLU MLP through the `swiglu` op (layers/mlp.py, ops/swiglu.py), on CPU.

The reference is stock transformers: each family's own MLP class, forward and backward, bit for bit
(the CPU path is stock's ops in stock's order, so the tolerance is zero). Memory is read through an
outer saved-tensor hook: what autograd holds of the `[tokens, intermediate]` width in a layer that
keeps its activations.
"""

from __future__ import annotations

import contextlib
import types

import pytest
import torch
import torch.nn.functional as F

from axolotl_fastqwen import patch_model, registry, unpatch_model
from axolotl_fastqwen.ops.swiglu import reference_swiglu
from axolotl_fastqwen.transformers_functions import stock_torch_kernels
from test_patching import FAMILIES, LORA_TARGETS, model_for, packed_batch, sequences


def _mlps(model):
    plan = registry.family(model.config.model_type).resolve()
    return [m for m in model.modules() if type(m) in plan.mlp]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_reference_is_silu_times_up_bitwise(dtype):
    gate = torch.randn(3, 7, 40, dtype=dtype, requires_grad=True)
    up = torch.randn(3, 7, 40, dtype=dtype, requires_grad=True)
    dy = torch.randn(3, 7, 40, dtype=dtype)
    ours = reference_swiglu(gate, up)
    d_ours = torch.autograd.grad(ours, (gate, up), dy)
    stock = F.silu(gate) * up
    d_stock = torch.autograd.grad(stock, (gate, up), dy)
    assert torch.equal(ours, stock) and all(torch.equal(a, b) for a, b in zip(d_ours, d_stock))
    # only one input needing a gradient (a frozen up projection's output, say)
    (d_gate,) = torch.autograd.grad(reference_swiglu(gate, up.detach()), gate, dy)
    assert torch.equal(d_gate, d_stock[0])


@pytest.mark.parametrize("family", FAMILIES)
def test_patched_mlp_is_the_familys_stock_mlp_bitwise(family):
    """Every patched MLP (MoE families: the shared expert) against its class's own forward on the same
    module: output, input gradient and weight gradients equal bit for bit."""
    model = model_for(family)
    report = patch_model(model, log=False)
    try:
        mlps = _mlps(model)
        assert report.mlps == len(mlps) == 4 and report.backends()["swiglu"] == "torch"
        mlp = mlps[1]
        x = torch.randn(1, 11, model.config.hidden_size)
        dy = torch.randn(1, 11, model.config.hidden_size)
        results = []
        for forward in (mlp, lambda t: type(mlp).forward(mlp, t)):
            xi = x.clone().requires_grad_()
            out = forward(xi)
            grads = torch.autograd.grad(out, (xi, *mlp.parameters()), dy)
            results.append((out, grads))
        (ours, g_ours), (stock, g_stock) = results
        assert torch.equal(ours, stock) and all(torch.equal(a, b) for a, b in zip(g_ours, g_stock))
    finally:
        unpatch_model(model)
    assert not any("forward" in vars(m) for m in _mlps(model))


def _held_intermediates(model, lean: bool | None) -> int:
    """How many storages of `tokens x intermediate` elements autograd holds from the MLPs' forwards, after
    one forward of a model whose layers all keep their activations; lean None: stock (unpatched)."""
    if lean is not None:
        patch_model(model, lean_activations=lean, log=False)
    # one sequence (stock runs it too), of a length that no weight's size matches
    batch = {"input_ids": sequences(model.config.vocab_size, [37])[0][None]}
    tokens = batch["input_ids"].numel()
    width = getattr(model.config, "shared_expert_intermediate_size", None) or model.config.intermediate_size
    held, inside = set(), []

    def pack(t):
        if inside and t.shape and t.shape[-1] == width and t.numel() == tokens * width:
            held.add(t.untyped_storage().data_ptr())
        return t

    def enter(*args):
        inside.append(True)

    def leave(*args):
        inside.pop()

    hooks = [h for m in _mlps(model) for h in (m.register_forward_pre_hook(enter), m.register_forward_hook(leave))]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
                (stock_torch_kernels(model.config.model_type) if lean is None else contextlib.nullcontext()):
            out = model(**batch)
        del out
    finally:
        for h in hooks:
            h.remove()
        if lean is not None:
            unpatch_model(model)
    return len(held)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_a_kept_layer_holds_gate_and_up_alone(family):
    """LoRA on down_proj saves its input (the product). Stock holds gate, silu(gate), up and the
    product of each MLP; the patched MLP gate, up and the product; with lean activations gate and up
    alone (the product is rebuilt from them in backward)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = get_peft_model(model_for(family), LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS))
    stock = _held_intermediates(model, None)
    patched = _held_intermediates(model, False)
    lean = _held_intermediates(model, True)
    assert (stock, patched, lean) == (4 * 4, 3 * 4, 2 * 4)


def test_lean_mlp_trains_as_without_lean_bitwise():
    """A layer that keeps its activations and rebuilds the MLP product in backward gives the gradients
    of the one that holds it, bit for bit."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = get_peft_model(model_for("qwen3_5"), LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS,
                                                            init_lora_weights=False))
    batch = packed_batch(sequences(model.config.vocab_size))
    runs = []
    for lean in (False, True):
        report = patch_model(model, lean_activations=lean, log=False)
        model.zero_grad(set_to_none=True)
        loss = model(**batch, num_items_in_batch=torch.tensor(1)).loss
        loss.backward()
        runs.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
        if lean:
            dropped = report.to_dict()["lean_activations"]["outputs_dropped_per_forward"]
        unpatch_model(model)
    (loss0, g0), (loss1, g1) = runs
    assert torch.equal(loss0, loss1) and all(torch.equal(g0[k], g1[k]) for k in g0)
    assert dropped >= 4  # each layer's MLP product at least (plus the norms' outputs)


def test_an_mlp_another_integration_runs_is_left_to_it(monkeypatch):
    """Axolotl's `lora_mlp_kernel` binds its forward to each MLP instance; `liger_glu_activation` swaps
    the modeling module's MLP class for Liger's before the model is built. Either way the plugin leaves
    those MLPs alone, and the report says the op is off where none is its own."""

    def theirs(self, x):
        return x

    model = model_for("qwen3_5")
    bound = model.model.layers[0].mlp
    bound.forward = types.MethodType(theirs, bound)
    report = patch_model(model, log=False)
    try:
        assert report.mlps == 3 and bound.forward.__func__ is theirs
    finally:
        unpatch_model(model)
    assert bound.forward.__func__ is theirs

    plan = registry.family("qwen3_5").resolve()
    (stock,) = plan.mlp
    foreign = type("LigerLikeSwiGLUMLP", (stock,), {"__module__": "liger_kernel.transformers.swiglu"})
    monkeypatch.setattr(plan.module, stock.__name__, foreign)
    model = model_for("qwen3_5")
    assert type(model.model.layers[0].mlp) is foreign
    report = patch_model(model, log=False)
    try:
        assert report.mlps == 0 and report.backends()["swiglu"].startswith("off")
        assert "SwiGLU" not in report.format().splitlines()[0]
    finally:
        unpatch_model(model)


def test_an_mlp_with_another_activation_is_not_patched():
    model = model_for("qwen3_5")
    for layer in model.model.layers[:2]:
        layer.mlp.act_fn = torch.nn.GELU()
    report = patch_model(model, log=False)
    try:
        assert report.mlps == 2 and "forward" not in vars(model.model.layers[0].mlp)
    finally:
        unpatch_model(model)


def test_swiglu_mlps_false_leaves_every_mlp_stock_and_says_so():
    """The bench's before path (D): `patch_model(swiglu_mlps=False)` patches no MLP, and the report names
    the argument as the reason, not another integration."""
    model = model_for("qwen3_5_moe")
    report = patch_model(model, swiglu_mlps=False, log=False)
    try:
        assert report.mlps == 0 and not any("forward" in vars(m) for m in _mlps(model))
        assert report.backends()["swiglu"] == "off (patch_model(swiglu_mlps=False): the MLPs stay stock)"
    finally:
        unpatch_model(model)
