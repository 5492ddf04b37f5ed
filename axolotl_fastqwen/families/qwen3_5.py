"""Qwen3.5 / 3.6 / 3.8 dense (`qwen3_5`, `qwen3_5_text`): separate q|k|v, z, b, a projections."""

from __future__ import annotations

from ..hookspecs import hookimpl
from .base import Family


def project_split(layer, hidden_states):
    """`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`: each a Linear, or its peft LoRA wrapper;
    or, where Axolotl's `lora_qkv_kernel` attached it, its fused LoRA autograd node for all four
    (`apply_in_proj_fused`: one input read, base and adapter matmuls together)."""
    batch, seq_len, _ = hidden_states.shape
    fused = getattr(layer, "apply_in_proj_fused", None)
    if fused is not None:
        out = fused(hidden_states)
        mixed_qkv, z, b, a = (out[name] for name in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"))
    else:
        mixed_qkv, z = layer.in_proj_qkv(hidden_states), layer.in_proj_z(hidden_states)
        b, a = layer.in_proj_b(hidden_states), layer.in_proj_a(hidden_states)
    return mixed_qkv, z.reshape(batch, seq_len, -1, layer.head_v_dim), b, a


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
