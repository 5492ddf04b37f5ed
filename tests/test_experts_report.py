"""The load report names who runs the routed experts, read from the live model (issue 13).

Reference: transformers' own state, not the plugin's: the experts modules counted by class, the
config's `_experts_implementation` as `set_experts_implementation` leaves it, and the function
transformers' `ExpertsInterface` dispatches that name to.
"""

from __future__ import annotations

import pytest
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

from axolotl_fastqwen import patch_model, unpatch_model
from tiny_assets import build_tiny_model

MOE = ["qwen3_5_moe", "qwen3_next"]


def stock_experts(model):
    return [m for m in model.modules() if type(m).__name__.endswith("Experts")]


@pytest.mark.parametrize("family", MOE)
def test_report_names_the_experts_implementation_and_follows_changes_after_load(family):
    model = build_tiny_model(family)
    report = patch_model(model, log=False)
    try:
        experts = stock_experts(model)
        assert experts
        seen = report.to_dict()["experts"]
        assert seen["modules"] == len(experts)
        assert seen["class"] == type(experts[0]).__qualname__
        assert seen["implementation"] == experts[0].config._experts_implementation
        # set after the plugin patched (as Axolotl's loader or a user may do): the report follows
        model.set_experts_implementation("batched_mm")
        seen = report.to_dict()["experts"]
        assert seen["implementation"] == "batched_mm"
        fn = ALL_EXPERTS_FUNCTIONS["batched_mm"]
        assert f"{fn.__module__}.{fn.__qualname__}" in seen["runner"]
        assert "routed experts" in report.format() and "batched_mm" in report.format()
        model.set_experts_implementation("eager")
        assert "eager" in report.to_dict()["experts"]["runner"]
    finally:
        unpatch_model(model)


def test_report_counts_experts_under_peft_target_parameters_once():
    peft = pytest.importorskip("peft")
    model = build_tiny_model("qwen3_5_moe")
    n = len(stock_experts(model))
    lora = peft.get_peft_model(model, peft.LoraConfig(
        r=4, target_modules=["q_proj"], target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]))
    assert any(type(m).__name__ == "ParamWrapper" for m in lora.modules())
    report = patch_model(lora, log=False)
    try:
        seen = report.to_dict()["experts"]
        assert seen["modules"] == n and seen["class"] == "Qwen3_5MoeExperts", seen
    finally:
        unpatch_model(lora)


def test_dense_model_has_no_experts_entry():
    model = build_tiny_model("qwen3_5")
    report = patch_model(model, log=False)
    try:
        assert report.to_dict()["experts"] is None
        assert "routed experts" not in report.format()
    finally:
        unpatch_model(model)
