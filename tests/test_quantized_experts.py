"""Routed experts stored in 4 or 8 bits by Axolotl's `quantize_moe_experts` run the plugin's
`fastqwen_grouped` (`layers/quantized_stacks.py`), with its shared-expert term and its factored expert LoRA.

The stacks are quantized with bitsandbytes' `replace_parameter_4bit`, the call Axolotl's loader makes for
each expert stack as it loads on a GPU (`axolotl.monkeypatch.moe_quant`), nf4 with double quantization as
Axolotl sets it; 8-bit stacks carry Axolotl's own `Bnb8bitParametrization`.

Reference: the same quantized model on transformers' own forward (the stock PyTorch kernels, the experts on
transformers' eager loop), run before the plugin patches it. fp32 on a CPU: the same dequantized weights,
the same math in another order, so the tolerance is fp32 round-off over the model (measured <= 3e-6
relative; bound 1e-5). Before the change these stacks silently kept transformers' experts and the
block's own forward (the report had no line on them).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize

from axolotl_fastqwen import patch_model, unpatch_model
from axolotl_fastqwen.layers import grouped_experts
from axolotl_fastqwen.layers.experts_implementation import EXPERT_WEIGHTS, experts_modules, set_experts_implementation
from axolotl_fastqwen.transformers_functions import stock_torch_kernels
from saved_tensors import SavedTensors
from tiny_assets import build_tiny_model

pytest.importorskip("transformers.integrations.moe")
bnb_parametrize = pytest.importorskip("bitsandbytes.nn.parametrize")

MOE = ["qwen3_5_moe", "qwen3_next"]
TOL = 1e-5


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def quantize_experts(model: nn.Module) -> None:
    """What `quantize_moe_experts` with `load_in_4bit` leaves on each experts module."""
    for module in experts_modules(model):
        for name in EXPERT_WEIGHTS:
            bnb_parametrize.replace_parameter_4bit(module, name, quant_type="nf4", compress_statistics=True)


def axolotls_peft_matching(monkeypatch) -> None:
    """Axolotl's patch of peft for `target_parameters` on quantized stacks (its loader applies it with
    `quantize_moe_experts`), undone after the test: it replaces peft methods for the whole process."""
    moe_quant = pytest.importorskip("axolotl.monkeypatch.moe_quant")
    from peft.tuners.lora.layer import ParamWrapper
    from peft.tuners.tuners_utils import BaseTuner

    for cls, name in ((BaseTuner, "_inject_parameters"), (BaseTuner, "_check_target_module_exists"),
                      (ParamWrapper, "_activate_lora"), (ParamWrapper, "_remove_parametrizations")):
        monkeypatch.setattr(cls, name, getattr(cls, name))  # recorded: put back when the test ends
    monkeypatch.setattr(moe_quant.patch_peft_target_parameters_matching, "_axolotl_patched", False, raising=False)
    moe_quant.patch_peft_target_parameters_matching()


def quantized_model(family: str, monkeypatch=None) -> nn.Module:
    """The tiny model with 4-bit experts; with `monkeypatch`, also peft's LoRA on the attention and the
    experts (Axolotl's matching patch in place for the test)."""
    model = build_tiny_model(family).train()
    quantize_experts(model)
    if monkeypatch is None:
        return model
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model

    axolotls_peft_matching(monkeypatch)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False,
                        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    return get_peft_model(model, config)


def step(model: nn.Module, ids: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def base_of(model: nn.Module) -> nn.Module:
    return model.get_base_model() if hasattr(model, "get_base_model") else model


@pytest.mark.parametrize("expert_lora", [False, True], ids=["frozen-experts", "expert-lora"])
@pytest.mark.parametrize("family", MOE)
def test_4bit_experts_train_as_transformers_on_the_same_quantized_base(family, expert_lora, monkeypatch):
    model = quantized_model(family, monkeypatch if expert_lora else None)
    ids = torch.randint(0, model.config.vocab_size, (2, 37), generator=torch.Generator().manual_seed(3))
    base = base_of(model)
    before = grouped_experts.REPLACES
    set_experts_implementation(base, "eager")
    with stock_torch_kernels():
        ref_loss, ref_grads = step(model, ids)
    set_experts_implementation(base, before)

    report = patch_model(model, log=False)
    experts = report.to_dict()["experts"]
    assert experts["implementation"] == grouped_experts.GROUPED
    assert experts["stacks"].startswith("gate_up_proj and down_proj stored as bitsandbytes 4-bit nf4")
    assert "none kept" in experts["stacks"] and "stacks:" in report.format()
    assert "added in the routed rows' sum" in experts["shared_expert"]
    loss, grads = step(model, ids)
    assert abs(loss - ref_loss) <= TOL * abs(ref_loss)
    assert grads.keys() == ref_grads.keys()
    if expert_lora:
        assert sum("lora" in n and "experts" in n for n in grads) == 4 * base.config.num_hidden_layers
        with torch.no_grad():
            model(input_ids=ids)  # the report's note on the factored path comes with the forward after one ran
        assert any("runs factored" in n for n in report.to_dict()["notes"]), report.to_dict()["notes"]
    for name in ref_grads:
        assert rel(grads[name], ref_grads[name]) <= TOL, name

    unpatch_model(model)
    with stock_torch_kernels():
        assert step(model, ids)[0] == pytest.approx(ref_loss, rel=TOL)


def stacks_among(saved: list[tuple[int, ...]], stacks) -> int:
    """How many saved tensors have a stack's shape or its transpose's (a grouped GEMM takes `[E, in, out]`)."""
    shapes = {tuple(s) for s in stacks} | {(*s[:-2], s[-1], s[-2]) for s in stacks}
    return sum(shape in shapes for shape in saved)


def test_a_4bit_stack_is_dequantized_again_in_backward_not_kept(monkeypatch):
    """Autograd's grouped GEMM keeps its weight operand for the input's gradient: transformers' experts hold
    both dequantized stacks from forward to backward (the control shows the probe sees them). The plugin
    keeps neither, and dequantizes each stack once in the forward and once in the backward."""
    model = quantized_model("qwen3_5_moe")
    experts = experts_modules(model)[0]
    shapes = [experts.parametrizations[n][0].quant_state.shape for n in EXPERT_WEIGHTS]
    hidden = torch.randn(29, model.config.hidden_size, generator=torch.Generator().manual_seed(5), requires_grad=True)
    index = torch.randint(0, experts.num_experts, (29, 2), generator=torch.Generator().manual_seed(6))
    weights = torch.rand(29, 2)
    calls = []
    real = bnb_parametrize.Bnb4bitParametrization.forward
    monkeypatch.setattr(bnb_parametrize.Bnb4bitParametrization, "forward",
                        lambda self, q: calls.append(id(self)) or real(self, q))

    with SavedTensors() as stock:
        experts(hidden, index, weights).sum().backward()
    assert stacks_among(stock.shapes, shapes) == 2

    patch_model(model, log=False)
    assert grouped_experts.grouped_experts_forward.__name__ in grouped_experts.describe_routed_kernels.__globals__
    calls.clear()
    with SavedTensors() as ours:
        out = experts(hidden, index, weights)
        forward_calls = len(calls)
        out.sum().backward()
    assert stacks_among(ours.shapes, shapes) == 0
    assert forward_calls == 2 and len(calls) == 4  # each stack: once in the forward, once in the backward
    unpatch_model(model)


def test_4bit_experts_in_bf16_follow_transformers_bf16_experts():
    """bf16 stacks (the dequantized dtype of a bf16 model): the rows, the gradient and the GEMMs in bf16, as
    transformers' grouped_mm runs them; bf16 round-off over one block (bound 2e-2, measured ~4e-3)."""
    model = build_tiny_model("qwen3_5_moe", dtype=torch.bfloat16).train()
    quantize_experts(model)
    block = model.model.layers[0].mlp
    hidden = torch.randn(1, 31, model.config.hidden_size, generator=torch.Generator().manual_seed(8)).bfloat16()

    def run():
        x = hidden.clone().requires_grad_(True)
        block.zero_grad(set_to_none=True)
        out = block(x)
        (out.float() * torch.linspace(-1, 1, out.numel()).view(out.shape)).sum().backward()
        return out.detach().float(), x.grad.float()

    reference = run()  # transformers' block, its experts on grouped_mm
    patch_model(model, fused_cross_entropy=False, log=False)
    assert grouped_experts.compute_dtype(block.experts) == torch.bfloat16
    ours = run()
    assert rel(ours[0], reference[0]) <= 2e-2 and rel(ours[1], reference[1]) <= 2e-2
    unpatch_model(model)


def test_axolotls_8bit_stacks_run_the_plugins_experts():
    """`quantize_moe_experts` with `load_in_8bit`: Axolotl's own `Bnb8bitParametrization` (int8 rows, float32
    row scales; bitsandbytes' CPU backend cannot quantize a 3-D stack, so the int8 data is made here with its
    2-D quantizer, as its CUDA kernel does row by row), dequantized to float32 as transformers would read it."""
    moe_quant = pytest.importorskip("axolotl.monkeypatch.moe_quant")
    import bitsandbytes.functional as bnbf

    model = build_tiny_model("qwen3_5_moe").train()
    for module in experts_modules(model):
        for name in EXPERT_WEIGHTS:
            stack = getattr(module, name).detach()
            data, stats, _ = bnbf.int8_vectorwise_quant(stack.reshape(-1, stack.shape[-1]).half())
            setattr(module, name, nn.Parameter(data.view(stack.shape), requires_grad=False))
            parametrize.register_parametrization(module, name, moe_quant.Bnb8bitParametrization(stats), unsafe=True)
    ids = torch.randint(0, model.config.vocab_size, (1, 41), generator=torch.Generator().manual_seed(4))
    set_experts_implementation(model, "eager")
    with stock_torch_kernels():
        ref_loss, ref_grads = step(model, ids)
    set_experts_implementation(model, grouped_experts.REPLACES)
    report = patch_model(model, log=False)
    experts = report.to_dict()["experts"]
    assert experts["implementation"] == grouped_experts.GROUPED
    assert "bitsandbytes int8, row-wise scales, dequantized to float32" in experts["stacks"]
    loss, grads = step(model, ids)
    assert abs(loss - ref_loss) <= TOL * abs(ref_loss) and grads.keys() == ref_grads.keys()
    for name in ref_grads:
        assert rel(grads[name], ref_grads[name]) <= TOL, name
    unpatch_model(model)


class _Halved(nn.Module):
    """A parametrization the plugin does not know (another quantizer's, say)."""

    def forward(self, w):
        return w * 0.5


def test_a_stack_behind_an_unknown_parametrization_keeps_transformers_experts_and_says_why():
    model = build_tiny_model("qwen3_5_moe").train()
    for module in experts_modules(model):
        parametrize.register_parametrization(module, "gate_up_proj", _Halved())
    ids = torch.randint(0, model.config.vocab_size, (1, 23), generator=torch.Generator().manual_seed(2))
    with stock_torch_kernels():
        ref_loss, _ = step(model, ids)
    report = patch_model(model, log=False)
    experts = report.to_dict()["experts"]
    assert experts["implementation"] == grouped_experts.REPLACES
    assert experts["not_grouped"].startswith(f"not {grouped_experts.GROUPED}: gate_up_proj is parametrized by ")
    assert "_Halved, which the plugin does not read" in experts["not_grouped"]
    assert "_Halved" in experts["stacks"] and "not fastqwen_grouped" in report.format()
    assert step(model, ids)[0] == pytest.approx(ref_loss, rel=TOL)
    unpatch_model(model)


def test_fp8_leaves_4bit_stacks_alone_and_says_why():
    """`fastqwen_fp8` quantizes frozen bf16 stacks; a 4-bit one would be quantized twice."""
    from axolotl_fastqwen.patching.fp8_weights import expert_candidates

    model = quantized_model("qwen3_5_moe")
    patch_model(model, log=False)
    found, refused = expert_candidates([model.model])
    assert not found
    assert refused["mlp.experts.gate_up_proj"].startswith("stored as bitsandbytes 4-bit nf4 (quantize_moe_experts)")
    unpatch_model(model)


def test_the_experts_self_check_runs_on_4bit_stacks():
    """The first-forward self-check (run here on the CPU, as the check's own tests do) copies a quantized
    stack as its dequantized values and passes fastqwen_grouped against the eager loop."""
    from axolotl_fastqwen.kernel_choice.experts_selfcheck import selfcheck_experts

    model = quantized_model("qwen3_5_moe")
    patch_model(model, log=False)
    check = selfcheck_experts(model, torch.float32, devices=("cpu",))
    assert check.implementation == grouped_experts.GROUPED and not check.rejected, check
    assert check.selfcheck.startswith("fwd+bwd rel. error"), check.selfcheck
    unpatch_model(model)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_4bit_experts_under_gradient_checkpointing(reentrant, monkeypatch):
    """Recomputed layers run the dequantizing GEMMs again in the recompute (one dequantization more a stack
    a step; without checkpointing two, less the first layer's gate_up in backward: nothing before the
    first expert LoRA needs a gradient): the loss and the gradients of the run without checkpointing, bit for bit (the
    same ops in the same order)."""
    model = quantized_model("qwen3_5_moe", monkeypatch)
    ids = torch.randint(0, model.config.vocab_size, (1, 45), generator=torch.Generator().manual_seed(9))
    calls = []
    real = bnb_parametrize.Bnb4bitParametrization.forward
    monkeypatch.setattr(bnb_parametrize.Bnb4bitParametrization, "forward", lambda self, q: calls.append(1) or real(self, q))
    patch_model(model, log=False)
    loss, grads = step(model, ids)
    stacks = 2 * base_of(model).config.num_hidden_layers
    plain = len(calls)
    assert plain == 2 * stacks - 1
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    if reentrant:
        model.enable_input_require_grads()  # reentrant checkpointing needs an input that requires grad
    calls.clear()
    again, again_grads = step(model, ids)
    # forward, recompute, backward: each stack three times (with checkpointing peft makes the embeddings'
    # output require grad, so the first layer's gate_up takes its backward too)
    assert len(calls) == 3 * stacks
    assert again == loss and again_grads.keys() == grads.keys()
    assert all(torch.equal(again_grads[n], grads[n]) for n in grads)
    unpatch_model(model)


def test_axolotls_peft_patch_is_undone_after_each_test():
    """The tests above patch peft as Axolotl's loader does; the next test file sees peft's own methods."""
    from peft.tuners.lora.layer import ParamWrapper
    from peft.tuners.tuners_utils import BaseTuner

    for cls, name in ((BaseTuner, "_inject_parameters"), (BaseTuner, "_check_target_module_exists"),
                      (ParamWrapper, "_activate_lora"), (ParamWrapper, "_remove_parametrizations")):
        assert getattr(cls, name).__module__.startswith("peft."), (cls, name, getattr(cls, name).__module__)
