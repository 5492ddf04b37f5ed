"""Qwen3.5 / 3.6 / 3.8 dense (`qwen3_5`, `qwen3_5_text`): separate q|k|v, z, b, a projections."""

from __future__ import annotations

from ..hookspecs import hookimpl
from .base import Family


def project_split(layer, hidden_states):
    """`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`: each a Linear, or its peft LoRA wrapper."""
    batch, seq_len, _ = hidden_states.shape
    mixed_qkv = layer.in_proj_qkv(hidden_states)
    z = layer.in_proj_z(hidden_states).reshape(batch, seq_len, -1, layer.head_v_dim)
    return mixed_qkv, z, layer.in_proj_b(hidden_states), layer.in_proj_a(hidden_states)


FAMILY = Family(
    name="qwen3_5",
    model_types=("qwen3_5", "qwen3_5_text"),
    modeling_module="transformers.models.qwen3_5.modeling_qwen3_5",
    gated_deltanet=("Qwen3_5GatedDeltaNet",),
    attention=("Qwen3_5Attention",),
    decoder_models=("Qwen3_5TextModel",),
    causal_lms=("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration"),
    project_gated_deltanet=project_split,
)


@hookimpl
def fastqwen_families():
    return [FAMILY]
