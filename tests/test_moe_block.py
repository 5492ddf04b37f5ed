"""The sparse MoE block's shared expert added inside the routed sum (`layers/moe_block.py`), against
transformers' own block.

Reference: the same block on transformers' forward (the unpatched model, or `unpatch_model`), the
experts on transformers' eager loop. fp32 on a CPU: the same math in another order (the shared term
in the routed sum's fp32 accumulator instead of a multiply and an add), so the tolerance is fp32
round-off over one block (measured <= 3e-7 relative; bound 1e-5).
"""

from __future__ import annotations

import copy

import pytest
import torch

from axolotl_fastqwen import patch_model, unpatch_model
from axolotl_fastqwen.layers import grouped_experts
from axolotl_fastqwen.layers.experts_implementation import experts_modules
from axolotl_fastqwen.layers.moe_block import OWN_FORWARD_ATTR
from tiny_assets import build_tiny_model

pytest.importorskip("transformers.integrations.moe")

MOE = ["qwen3_5_moe", "qwen3_next"]
TOL = 1e-5


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def blocks(model):
    return [layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "shared_expert_gate")]


def block_run(block, hidden):
    x = hidden.clone().requires_grad_(True)
    block.zero_grad(set_to_none=True)
    out = block(x)
    (out * torch.linspace(-1, 1, out.numel()).view(out.shape)).sum().backward()
    grads = {n: p.grad.clone() for n, p in block.named_parameters() if p.grad is not None}
    return out.detach(), x.grad, grads


class _Counted:
    """Counts the routed sums that carry the shared expert's term."""

    def __init__(self, monkeypatch):
        self.calls = 0
        real = grouped_experts._sum_per_token

        def counted(*args):
            self.calls += len(args) > 6 and args[6] is not None
            return real(*args)

        monkeypatch.setattr(grouped_experts, "_sum_per_token", counted)


@pytest.mark.parametrize("family", MOE)
def test_the_patched_block_is_transformers_block_with_the_term_in_the_sum(family, monkeypatch):
    """Output and gradients (the input's, the shared expert's, its gate's, the router's and the experts')
    of every sparse block against transformers' block with the eager experts; the report counts the
    blocks; `unpatch_model` gives the block its own forward back."""
    model = build_tiny_model(family).train()
    block = blocks(model)[0]
    hidden = torch.randn(2, 23, model.config.hidden_size, generator=torch.Generator().manual_seed(4))
    stock = copy.deepcopy(block)
    stock.experts.config = copy.copy(stock.experts.config)
    stock.experts.config._experts_implementation = "eager"
    reference = block_run(stock, hidden)

    report = patch_model(model, fused_cross_entropy=False, log=False)
    assert report.moe_blocks == len(blocks(model)) == model.config.num_hidden_layers
    assert "added in the routed rows' sum" in report.to_dict()["experts"]["shared_expert"]
    assert "shared expert: its gated output" in report.format()
    counted = _Counted(monkeypatch)
    ours = block_run(block, hidden)
    assert counted.calls == 1
    assert rel(ours[0], reference[0]) <= TOL and rel(ours[1], reference[1]) <= TOL
    assert ours[2].keys() == reference[2].keys() and {"shared_expert_gate.weight", "gate.weight"} <= ours[2].keys()
    for name in reference[2]:
        assert rel(ours[2][name], reference[2][name]) <= TOL, name
    unpatch_model(model)
    assert "forward" not in block.__dict__ and "_fastqwen" not in block.__dict__
    counted.calls = 0
    again = block_run(block, hidden)
    assert counted.calls == 0 and rel(again[0], reference[0]) <= TOL


def test_experts_on_another_implementation_keep_the_block_s_own_forward(monkeypatch):
    """Experts on transformers' eager loop (or ScatterMoE, ...) cannot take the term: the block runs
    transformers' forward, and the report says so."""
    model = build_tiny_model("qwen3_5_moe").train()
    report = patch_model(model, fused_cross_entropy=False, log=False)
    model.set_experts_implementation("eager")
    counted = _Counted(monkeypatch)
    hidden = torch.randn(1, 9, model.config.hidden_size)
    out = blocks(model)[0](hidden)
    assert counted.calls == 0 and out.shape == hidden.shape
    assert report.to_dict()["experts"]["shared_expert"] == "transformers' block forward"
    assert not grouped_experts.takes_shared_expert(experts_modules(model)[0])
    model.set_experts_implementation(grouped_experts.GROUPED)
    blocks(model)[0](hidden)
    assert counted.calls == 1
    blocks(model)[0].__dict__[OWN_FORWARD_ATTR] = True  # bench path C's pin
    blocks(model)[0](hidden)
    assert counted.calls == 1
    unpatch_model(model)


def test_a_block_forward_another_integration_bound_is_left_alone():
    """An instance forward bound by someone else (Axolotl's LoRA MLP kernel binds its own) is not
    replaced; a class forward patched by another integration is not either."""
    model = build_tiny_model("qwen3_5_moe")
    first = blocks(model)[0]
    theirs = lambda hidden_states: hidden_states  # noqa: E731
    first.forward = theirs
    report = patch_model(model, fused_cross_entropy=False, log=False)
    assert first.forward is theirs and report.moe_blocks == len(blocks(model)) - 1
    unpatch_model(model)

    cls = type(first)
    original = cls.forward
    try:
        cls.forward = lambda self, hidden_states: original(self, hidden_states)
        report = patch_model(build_tiny_model("qwen3_5_moe"), fused_cross_entropy=False, log=False)
        assert report.moe_blocks == 0 and "no sparse block" in report.to_dict()["experts"]["shared_expert"]
    finally:
        cls.forward = original


def test_beneath_accelerate_s_hooks_the_experts_still_take_the_term(monkeypatch):
    """`device_map` puts accelerate's hook on every module: its wrapper in `forward`, the real forward in
    `_old_forward` (`layers/forward_slot.py`). The experts behind such a hook still take the shared
    term, and a forward someone bound beneath the hook still counts as theirs."""
    from accelerate.hooks import ModelHook, add_hook_to_module

    model = build_tiny_model("qwen3_5_moe").train()
    patch_model(model, fused_cross_entropy=False, log=False)
    try:
        experts = experts_modules(model)[0]
        add_hook_to_module(experts, ModelHook())
        assert "_old_forward" in experts.__dict__ and grouped_experts.takes_shared_expert(experts)
        counted = _Counted(monkeypatch)
        hidden = torch.randn(1, 9, model.config.hidden_size)
        blocks(model)[0](hidden)
        assert counted.calls == 1
        experts._old_forward = lambda *args, **kwargs: args[0]  # another integration's, beneath the hook
        assert not grouped_experts.takes_shared_expert(experts)
    finally:
        unpatch_model(model)
