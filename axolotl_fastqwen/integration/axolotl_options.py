"""How Axolotl's own speed options meet the plugin: superseded, composed with, or left alone.

A speed-minded Axolotl config already turns on Liger, cut cross-entropy, fused LoRA kernels,
fused attention and multipack. With the plugin in `plugins:` each of them either keeps running
inside the patched model (composed), is replaced by the plugin's own kernel for the same op
(superseded), or is left to do the job (the loss, with `fastqwen_fused_ce: false`). The load
report says which, per option, so nobody has to guess who computed what.
"""

from __future__ import annotations

from .settings import Settings

LOSS_OPTIONS = ("liger_fused_linear_cross_entropy", "cut_cross_entropy")
# Liger's Triton kernels that Axolotl's Liger plugin installs for Qwen3.5 (CUDA only).
LIGER_CUDA_ONLY = ("liger_rms_norm", "liger_rms_norm_gated", "liger_glu_activation", "liger_layer_norm",
                   "liger_rope", "liger_cross_entropy")


def check_device(settings: Settings, device_type: str) -> None:
    """Fail before the model loads when an Axolotl kernel option cannot run on this device."""
    if device_type == "cuda":
        return
    on = [key for key in LIGER_CUDA_ONLY if key in settings.axolotl_options]
    if settings.loss_owner:
        on.append(settings.loss_owner)
    if on:
        raise ValueError(
            f"{', '.join(f'`{k}: true`' for k in on)} run Triton kernels, which need a CUDA GPU; this run trains "
            f"on {device_type}. Set them false here (axolotl_fastqwen computes the loss itself on any device, "
            "without materialised logits, unless `fastqwen_fused_ce: false`)."
        )


def notes(settings: Settings, report) -> list[str]:
    """One line per Axolotl option this config turns on, saying what became of it."""
    on = set(settings.axolotl_options)
    out = []
    backends = report.backends()
    for key in LOSS_OPTIONS:
        if key not in on:
            continue
        if settings.loss_owner == key:
            out.append(f"{key}: computes the loss (fastqwen_fused_ce: false)")
        else:
            out.append(f"{key}: superseded: the loss is axolotl_fastqwen's {backends.get('linear_cross_entropy')} "
                       "(same definition; a step with no trainable token gives 0, not NaN); set fastqwen_fused_ce: "
                       f"false to leave it to {key}")
    if "liger_rms_norm_gated" in on:
        out.append(f"liger_rms_norm_gated: superseded by the patched Gated DeltaNet's "
                   f"{backends.get('gated_rmsnorm')} gated RMSNorm")
    composed = [key for key in ("liger_rms_norm", "liger_glu_activation", "lora_mlp_kernel") if key in on]
    if composed:
        out.append(f"{', '.join(composed)}: composed (they run inside the patched model)")
    lora_proj = [key for key in ("lora_qkv_kernel", "lora_o_kernel") if key in on]
    if lora_proj:
        out.append(f"{', '.join(lora_proj)}: composed: the patched attention and Gated DeltaNet layers call "
                   "Axolotl's fused LoRA projections")
    if "fused_attn_kernel" in on:
        out.append("fused_attn_kernel: superseded: the patched attention layers run their own forward "
                   f"({backends.get('varlen_attention')} over the packed boundaries)")
    if settings.rows == "multipack":
        out.append("sample_packing: Axolotl's multipack rows; its Qwen packing patch is superseded (boundaries are "
                   "read once per forward from its attention_mask ids)")
    return out
