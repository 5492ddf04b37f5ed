"""Patching a loaded model: `patch.py` installs the fused layers per instance and takes them off
(`patch_model` / `unpatch_model`, the `PatchReport`); what runs once per forward before the first
layer is `decoder_hook.py` (self-check trigger, peft's LoRA input cast in `lora_input_cast.py`, the
routed experts' LoRA in `expert_lora.py`, the batch's boundaries), and what the hook and the loss
share in one forward is `forward_context.py`."""

from .patch import PatchReport, is_patched, patch_model, unpatch_model

__all__ = ["PatchReport", "is_patched", "patch_model", "unpatch_model"]
