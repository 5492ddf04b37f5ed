"""peft's LoRA `Linear` layers run as one autograd function (`ops/lora_linear.py`): the adapter's
product added by the GEMM, both input gradients accumulated by it, no full-size scale or add.

Installed per instance, beneath accelerate's hook, at the first forward (adapters may come after
the patch: Axolotl applies LoRA after the plugin patches). Each call checks that the layer is the
plain case, `base(x) + s·B(A(x))` with one active unmerged adapter, no dropout, no DoRA or other
variant, no LoRA bias, a frozen `nn.Linear` base (bf16, or FP8 under `fastqwen_fp8`) in the compute
dtype; anything else (dropout > 0, mixed-adapter batches, merged or disabled adapters, fp32
adapters without autocast) runs peft's own forward, and the report counts both. Layers Axolotl's
LoRA kernels patch (its `lora_*_kernel`) never call this forward: those kernels do the same fusion.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch import nn

from ..ops.lora_linear import DenseBase, Fp8Base, lora_linear
from . import fp8_weights
from .instance_forward import replace_forward, restore_forward

KEY = "_fastqwen_fused_lora"


def peft_linear_layers(model: nn.Module) -> list[nn.Module]:
    """peft's LoRA `Linear` layers (exactly that class: its quantized and variant subclasses differ)."""
    try:
        from peft.tuners.lora.layer import Linear
    except ImportError:  # peft is optional outside Axolotl
        return []
    return [m for m in model.modules() if type(m) is Linear]


class FusedLoraForward:
    """One layer's instance forward: fused where the layer is the plain case, peft's otherwise."""

    def __init__(self, module: nn.Module, original, counts: Counter):
        self.module, self.original, self.counts = module, original, counts

    def __call__(self, x, *args, **kwargs):
        if torch.compiler.is_compiling():  # a compiled graph fuses peft's ops itself; no Python-side count in it
            return self.original(x, *args, **kwargs)
        plan = self._plan(x, args, kwargs)
        if isinstance(plan, str):
            self.counts[plan] += 1
            return self.original(x, *args, **kwargs)
        adapter, base, dtype = plan
        m = self.module
        self.counts["fused"] += 1
        return lora_linear(x, m.lora_A[adapter].weight, m.lora_B[adapter].weight, base, m.scaling[adapter], dtype)

    def _plan(self, x, args, kwargs):
        """(adapter, base, compute dtype), or why peft's forward runs instead."""
        m = self.module
        if args or kwargs:
            return "called with more than the input (e.g. adapter_names: a mixed-adapter batch)"
        if m.disable_adapters or m.merged:
            return "adapters disabled or merged"
        active = list(m.active_adapters)
        if len(active) != 1 or active[0] not in m.lora_A:
            return "not exactly one active adapter on the layer"
        adapter = active[0]
        if not isinstance(m.lora_dropout[adapter], nn.Identity):
            return "lora_dropout > 0"
        if (m.use_dora.get(adapter) or getattr(m, "lora_variant", {}).get(adapter) is not None
                or m.lora_bias.get(adapter) or m.fan_in_fan_out):
            return "a LoRA variant (DoRA, ...), lora_bias or fan_in_fan_out"
        base = m.base_layer
        if type(base) is not nn.Linear or base.weight.requires_grad or (base.bias is not None and base.bias.requires_grad):
            return "the base layer is not a frozen nn.Linear"
        device = x.device.type
        autocast = torch.is_autocast_enabled(device)
        dtype = torch.get_autocast_dtype(device) if autocast else x.dtype
        if not autocast and m.lora_A[adapter].weight.dtype != dtype:
            return "adapter and input dtypes differ without autocast"
        bias = base.bias.to(dtype) if base.bias is not None else None
        fp8 = fp8_weights.fp8_operands(base)
        if fp8 is not None:
            return adapter, Fp8Base(*fp8, bias=bias), dtype
        if base.weight.dtype != dtype:
            return "the base weight is not in the compute dtype"
        return adapter, DenseBase(base.weight, bias), dtype


class FusedLora:
    """Installs `FusedLoraForward` on every peft LoRA `Linear` at the first forward; `restore` takes
    them off."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.layers: list[nn.Module] | None = None
        self.counts: Counter = Counter()  # calls fused, and calls by why peft's forward ran

    def update(self) -> None:
        if self.layers is not None:
            return
        self.layers = peft_linear_layers(self.model)
        for module in self.layers:
            replace_forward(module, KEY, lambda original, module=module: FusedLoraForward(module, original, self.counts))

    def restore(self) -> None:
        for module in self.layers or []:
            restore_forward(module, KEY)
        self.layers = None

    def to_dict(self) -> dict:
        """Layers found, calls fused, and calls by why peft's forward ran (read live by the report)."""
        return {"layers": len(self.layers or []), "fused_calls": self.counts["fused"],
                "peft_calls": {why: n for why, n in self.counts.most_common() if why != "fused"}}
