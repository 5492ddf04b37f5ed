"""peft LoRA layers under autocast: skip the input upcast that autocast undoes at once.

peft keeps adapter weights in fp32 by default (`autocast_adapter_dtype=True`) and casts each
adapted layer's input to that dtype before the LoRA matmuls. Under autocast (the Trainer's
`bf16: true`) those matmuls run in bf16 anyway, so autocast casts the fp32 copy straight back: two
full-size copies of every adapted layer's input, forward and backward, ~10% of GPU time at the 27B
shapes (H200 profile, `benchmarks/h200/`). With autocast on, the matmul sees the same bf16 values
either way, so skipping the upcast changes no bit; with autocast off the upcast is needed (fp32
weights times bf16 input) and stays. DoRA and other LoRA variants are left alone.
"""

from __future__ import annotations

import torch
from torch import nn


def plain_lora_layers(model: nn.Module) -> list[nn.Module]:
    """peft LoRA layers whose forward is `base(x) + B(A(dropout(cast(x)))) * scale` (no variant)."""
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:  # peft is optional outside Axolotl
        return []
    return [
        m for m in model.modules()
        if isinstance(m, LoraLayer) and hasattr(m, "cast_input_dtype_enabled") and not getattr(m, "lora_variant", None)
        and not any(getattr(m, "use_dora", {}).values())
    ]


class LoraInputCast:
    """Per forward: peft's input cast off under autocast, as it was otherwise. Reversible."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.layers: list[nn.Module] | None = None  # found at the first forward: adapters may come later
        self.original: dict[nn.Module, bool] = {}
        self.skipping: bool | None = None
        self.skipped = False  # did any forward run with the cast skipped (i.e. under autocast)?

    def update(self, device_type: str) -> None:
        if self.layers is None:
            self.layers = plain_lora_layers(self.model)
            self.original = {m: m.cast_input_dtype_enabled for m in self.layers}
        skip = bool(self.layers) and torch.is_autocast_enabled(device_type)
        if skip != self.skipping:
            for m in self.layers:
                m.cast_input_dtype_enabled = False if skip else self.original[m]
            self.skipping = skip
        self.skipped |= skip

    def restore(self) -> None:
        for m, value in self.original.items():
            m.cast_input_dtype_enabled = value
        self.skipping = None

    def describe(self, fused: int = 0) -> str | None:
        """What happened, for the report: only once a forward under autocast has skipped the cast.
        `fused`: how many of the layers run the fused LoRA forward (`fused_lora.py`), which never
        upcasts: for those the skip matters only where they fall back to peft's forward."""
        if not self.layers or not self.skipped:
            return None
        unfused = len(self.layers) - min(fused, len(self.layers))
        if not unfused:
            return None
        if fused:
            return (f"{unfused} peft LoRA layers that do not run fused skip their fp32 input upcast under autocast "
                    "(autocast recasts to bf16 before the matmul: same bits, two copies fewer each way); the "
                    f"{len(self.layers) - unfused} fused ones never upcast")
        return (f"{len(self.layers)} peft LoRA layers skip their fp32 input upcast under autocast "
                "(autocast recasts to bf16 before the matmul: same bits, two copies fewer each way)")
