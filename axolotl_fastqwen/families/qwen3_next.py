"""Qwen3-Next (`qwen3_next`, e.g. 80B-A3B): fused `in_proj_qkvz` / `in_proj_ba`, laid out per key head."""

from __future__ import annotations

import torch

from ..hookspecs import hookimpl
from .base import Family


def project_fused(layer, hidden_states):
    """Un-interleave the per-key-head [q k v z] and [b a] groups with the layer's own method, so the
    layout logic stays transformers'; q|k|v is re-joined in the order the conv weights expect."""
    q, k, v, z, b, a = layer.fix_query_key_value_ordering(layer.in_proj_qkvz(hidden_states), layer.in_proj_ba(hidden_states))
    mixed_qkv = torch.cat([t.reshape(t.shape[0], t.shape[1], -1) for t in (q, k, v)], dim=-1)
    return mixed_qkv, z, b, a


FAMILY = Family(
    name="qwen3_next",
    model_types=("qwen3_next",),
    modeling_module="transformers.models.qwen3_next.modeling_qwen3_next",
    gated_deltanet=("Qwen3NextGatedDeltaNet",),
    attention=("Qwen3NextAttention",),
    decoder_models=("Qwen3NextModel",),
    causal_lms=("Qwen3NextForCausalLM",),
    project_gated_deltanet=project_fused,
)


@hookimpl
def fastqwen_families():
    return [FAMILY]
