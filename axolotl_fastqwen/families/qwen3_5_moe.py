"""Qwen3.5 MoE (`qwen3_5_moe`, `qwen3_5_moe_text`, e.g. 35B-A3B): the dense family's GDN layout,
routed experts plus a shared expert (LoRA on `gate/up/down_proj` reaches the shared expert)."""

from __future__ import annotations

from ..hookspecs import hookimpl
from .base import AxolotlNames, Family, PublishedShape
from .qwen3_5 import GDN_128, LORA_TARGETS, ROPE, project_split

FAMILY = Family(
    name="qwen3_5_moe",
    model_types=("qwen3_5_moe", "qwen3_5_moe_text"),
    modeling_module="transformers.models.qwen3_5_moe.modeling_qwen3_5_moe",
    text_config="Qwen3_5MoeTextConfig",
    causal_lm="Qwen3_5MoeForCausalLM",
    gated_deltanet="Qwen3_5MoeGatedDeltaNet",
    attention="Qwen3_5MoeAttention",
    rms_norm="Qwen3_5MoeRMSNorm",
    mlp="Qwen3_5MoeMLP",
    decoder="Qwen3_5MoeTextModel",
    project_gated_deltanet=project_split,
    lora_targets=LORA_TARGETS,
    composite_config="Qwen3_5MoeConfig",
    conditional_generation="Qwen3_5MoeForConditionalGeneration",
    moe=True,
    aux_loss="load_balancing_loss_func",
    moe_block="Qwen3_5MoeSparseMoeBlock",
    expert_parameters=("mlp.experts.gate_up_proj", "mlp.experts.down_proj"),
    shapes=(PublishedShape(
        "qwen3.5-35b-a3b", 40,
        dict(hidden_size=2048, num_attention_heads=16, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
             linear_num_value_heads=32, num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
             shared_expert_intermediate_size=512, vocab_size=248_320, tie_word_embeddings=False,
             rope_parameters=ROPE, **GDN_128),
        "Qwen3.5-35B-A3B MoE: hidden 2048, 40 layers, 16q/2kv x256, GDN 16k/32v x128, 256 experts top-8",
    ),),
    axolotl=AxolotlNames(
        packing=("axolotl.monkeypatch.models.qwen3_5.modeling", "patch_qwen3_5_moe_modeling_packing"),
        liger=("axolotl.integrations.liger.models.qwen3_5_moe", "apply_liger_kernel_to_qwen3_5_moe"),
        fused_attn=("axolotl.monkeypatch.models.qwen3_5_moe.fused_attn", "patch_qwen3_5_moe_fused_attn"),
    ),
)


@hookimpl
def fastqwen_families():
    return [FAMILY]
