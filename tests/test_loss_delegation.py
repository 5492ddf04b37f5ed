"""The plugin steps its fused loss aside only when another fused loss really replaced the forward.

Liger's Qwen3.5 patch (`liger_fused_linear_cross_entropy`) replaces `Qwen3_5ForCausalLM.forward`
only; on the vision-language checkpoints Axolotl loads `Qwen3_5ForConditionalGeneration`, whose
forward stays stock, so deferring to the key alone would leave the 248k-vocabulary logits
materialised with no fused loss at all.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from axolotl_fastqwen.plugin import loss_forward_replaced  # noqa: E402
from axolotl_fastqwen.tools import tiny_assets as ta  # noqa: E402


def _fake_lce_forward(self, *args, **kwargs):  # defined outside transformers, like Liger's lce_forward
    raise AssertionError("not called")


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_vl"])
def test_stock_forward_is_not_replaced(family):
    assert loss_forward_replaced(ta.build_tiny_model(family)) is False


def test_replaced_class_forward_is_seen_and_only_on_that_class(monkeypatch):
    import transformers

    monkeypatch.setattr(transformers.Qwen3_5ForCausalLM, "forward", _fake_lce_forward)
    assert loss_forward_replaced(ta.build_tiny_model("qwen3_5")) is True
    assert loss_forward_replaced(ta.build_tiny_model("qwen3_5_vl")) is False  # Liger's qwen3_5 patch: no-op here


def test_peft_wrapped_model_is_unwrapped(monkeypatch):
    peft = pytest.importorskip("peft")
    import transformers

    model = peft.get_peft_model(ta.build_tiny_model("qwen3_5"), peft.LoraConfig(r=2, target_modules=["q_proj"]))
    assert loss_forward_replaced(model) is False
    monkeypatch.setattr(transformers.Qwen3_5ForCausalLM, "forward", _fake_lce_forward)
    assert loss_forward_replaced(model) is True
