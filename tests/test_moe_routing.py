"""The routing pin of the GPU MoE parity test (`tests/moe_routing.py`), checked on tiny MoE models.

Imposing a run's own recorded routing on a second run of the same weights must reproduce it
exactly (fp32, same ops: bit-identical loss); imposing another routing must change the loss, and
the flipped share must count it. Without these the GPU parity test could pass by pinning nothing.
"""

from __future__ import annotations

import pytest
import torch

import moe_routing
from axolotl_fastqwen.transformers_functions import stock_torch_kernels
from tiny_assets import build_tiny_model


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_next"])
def test_imposing_the_recorded_routing_reproduces_the_run_and_another_routing_does_not(family):
    with stock_torch_kernels(family):
        _check_pin(family)


def _check_pin(family):
    model = build_tiny_model(family)
    ids = torch.randint(0, model.config.vocab_size, (1, 48), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids, "output_router_logits": True}
    recorded = {}
    with torch.no_grad(), moe_routing.record_routing(model, recorded):
        free = model(**batch)
    assert len(recorded) == len(moe_routing.routers(model)) and all(len(v) == 1 for v in recorded.values())
    with torch.no_grad(), moe_routing.impose_routing(model, recorded):
        pinned = model(**batch)
    assert torch.equal(pinned.loss, free.loss) and torch.equal(pinned.logits, free.logits)

    shifted = {m: [(c + 1) % m.num_experts for c in calls] for m, calls in recorded.items()}  # every choice moved
    again = {}
    with torch.no_grad(), moe_routing.impose_routing(model, shifted), moe_routing.record_routing(model, again):
        moved = model(**batch)
    assert not torch.allclose(moved.logits, free.logits, rtol=1e-3, atol=1e-4)
    assert moe_routing.flipped_fraction(recorded, recorded) == 0.0
    assert moe_routing.flipped_fraction(recorded, again) == 1.0  # the recorder sees the imposed choice


def test_a_run_with_a_different_number_of_router_calls_is_refused():
    with stock_torch_kernels("qwen3_5_moe"):
        _check_count()


def _check_count():
    model = build_tiny_model("qwen3_5_moe")
    ids = torch.randint(0, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(1))
    recorded = {}
    with torch.no_grad(), moe_routing.record_routing(model, recorded):
        model(input_ids=ids)
        model(input_ids=ids)
    with pytest.raises(AssertionError, match="router calls did not match"):
        with torch.no_grad(), moe_routing.impose_routing(model, recorded):
            model(input_ids=ids)
