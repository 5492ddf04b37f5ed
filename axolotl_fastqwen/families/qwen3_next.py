"""Qwen3-Next (`qwen3_next`, e.g. 80B-A3B): fused `in_proj_qkvz` / `in_proj_ba`, laid out per key head."""

from __future__ import annotations

import torch

from ..hookspecs import hookimpl
from .base import AxolotlNames, Family, PublishedShape
from .qwen3_5 import GDN_128, ROPE


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
    text_config="Qwen3NextConfig",
    causal_lm="Qwen3NextForCausalLM",
    gated_deltanet="Qwen3NextGatedDeltaNet",
    attention="Qwen3NextAttention",
    rms_norm="Qwen3NextRMSNorm",
    mlp="Qwen3NextMLP",
    decoder="Qwen3NextModel",
    project_gated_deltanet=project_fused,
    # q|k|v|z are fused into in_proj_qkvz. No gate/up/down_proj: for model_type qwen3_next peft 0.21
    # rewrites them (even shared_expert.gate_proj) into LoRA on the routed experts' 3D parameters.
    lora_targets=("q_proj", "k_proj", "v_proj", "o_proj", "out_proj", "in_proj_qkvz"),
    moe=True,
    aux_loss="load_balancing_loss_func",
    moe_block="Qwen3NextSparseMoeBlock",
    expert_parameters=("mlp.experts.gate_up_proj", "mlp.experts.down_proj"),
    mrope=False,  # plain (1-D) partial RoPE
    shapes=(PublishedShape(
        "qwen3-next-80b-a3b", 48,
        dict(hidden_size=2048, intermediate_size=5120, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
             linear_num_key_heads=16, linear_num_value_heads=32, num_experts=512, num_experts_per_tok=10,
             moe_intermediate_size=512, shared_expert_intermediate_size=512, decoder_sparse_step=1,
             mlp_only_layers=[], norm_topk_prob=True, vocab_size=151_936, tie_word_embeddings=False,
             rope_parameters={k: v for k, v in ROPE.items() if not k.startswith("mrope")}, **GDN_128),
        "Qwen3-Next-80B-A3B: hidden 2048, 48 layers, 512 experts top-10, fused in_proj_qkvz/ba",
    ),),
    toy=(("intermediate_size", 128), ("norm_topk_prob", True)),  # MoE every layer, a dense size for mlp_only_layers
    axolotl=AxolotlNames(
        packing=("axolotl.monkeypatch.models.qwen3_next.modeling", "patch_qwen3_next_modeling_packing"),
        liger=("liger_kernel.transformers.monkey_patch", "apply_liger_kernel_to_qwen3_next"),
    ),
)


@hookimpl
def fastqwen_families():
    return [FAMILY]
