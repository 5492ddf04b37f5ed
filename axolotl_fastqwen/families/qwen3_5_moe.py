"""Qwen3.5 MoE (`qwen3_5_moe`, `qwen3_5_moe_text`, e.g. 35B-A3B): the dense family's GDN layout."""

from __future__ import annotations

from ..hookspecs import hookimpl
from .base import Family
from .qwen3_5 import project_split

FAMILY = Family(
    name="qwen3_5_moe",
    model_types=("qwen3_5_moe", "qwen3_5_moe_text"),
    modeling_module="transformers.models.qwen3_5_moe.modeling_qwen3_5_moe",
    gated_deltanet=("Qwen3_5MoeGatedDeltaNet",),
    attention=("Qwen3_5MoeAttention",),
    decoder_models=("Qwen3_5MoeTextModel",),
    causal_lms=("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration"),
    project_gated_deltanet=project_split,
)


@hookimpl
def fastqwen_families():
    return [FAMILY]
