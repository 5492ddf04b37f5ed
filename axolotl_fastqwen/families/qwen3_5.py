"""Qwen3.5 / 3.6 / 3.8 dense (`qwen3_5`, `qwen3_5_text`): separate q|k|v, z, b, a projections."""

from __future__ import annotations

from ..hookspecs import hookimpl
from .base import AxolotlNames, Family, PublishedShape

# attention q/k/v/o, the Gated DeltaNet in/out projections, the MLP (MoE: the shared expert)
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "out_proj", "gate_proj", "up_proj", "down_proj",
                "in_proj_qkv", "in_proj_z")

# Qwen3.5's text rotary: theta 1e7, a quarter of each head, interleaved MRoPE [11, 11, 10]
ROPE = dict(rope_type="default", rope_theta=10_000_000.0, partial_rotary_factor=0.25, mrope_section=[11, 11, 10],
            mrope_interleaved=True)
GDN_128 = dict(linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4)


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
    text_config="Qwen3_5TextConfig",
    causal_lm="Qwen3_5ForCausalLM",
    gated_deltanet="Qwen3_5GatedDeltaNet",
    attention="Qwen3_5Attention",
    rms_norm="Qwen3_5RMSNorm",
    mlp="Qwen3_5MLP",
    decoder="Qwen3_5TextModel",
    project_gated_deltanet=project_split,
    lora_targets=LORA_TARGETS,
    composite_config="Qwen3_5Config",
    conditional_generation="Qwen3_5ForConditionalGeneration",
    shapes=(PublishedShape(
        "qwen3.5-27b", 64,
        dict(hidden_size=5120, intermediate_size=17408, num_attention_heads=24, num_key_value_heads=4, head_dim=256,
             linear_num_key_heads=16, linear_num_value_heads=48, vocab_size=248_320, tie_word_embeddings=False,
             rope_parameters=ROPE, **GDN_128),
        "Qwen3.5/3.6-27B dense: hidden 5120, [3 GDN, 1 full] x16, 24q/4kv x256, GDN 16k/48v x128",
    ),),
    toy=(("intermediate_size", 128),),
    axolotl=AxolotlNames(
        packing=("axolotl.monkeypatch.models.qwen3_5.modeling", "patch_qwen3_5_modeling_packing"),
        liger=("axolotl.integrations.liger.models.qwen3_5", "apply_liger_kernel_to_qwen3_5"),
        fused_attn=("axolotl.monkeypatch.models.qwen3_5.fused_attn", "patch_qwen3_5_fused_attn"),
    ),
)


@hookimpl
def fastqwen_families():
    return [FAMILY]
