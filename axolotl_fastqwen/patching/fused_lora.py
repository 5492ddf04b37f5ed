"""peft's LoRA `Linear` layers with the adapter's product added by its GEMM: `base(x) + s·B(A(x))` as
`addmm(base(x), A(x), Bᵀ, alpha=s)`.

peft runs the adapter as `result + lora_B(lora_A(x)) * scaling`: besides its two GEMMs, a full-size
multiply and add in every forward (again in every recompute) and the multiply again in backward, each
a pass over `[tokens, out]`. On the 35B-A3B profile with expert LoRA, bf16 adds and scalar multiplies
were 119 ms of the 656 ms of GPU kernel time of a step (benchmarks/h200/2026-12-04d). Here the second
GEMM adds into the base's output (`addmm_`, beta = 1): cuBLAS adds the product in its epilogue, and
autograd's own backward of it (native, no Python) scales only `[tokens, rank]` and `[rank, out]`
tensors and passes the base output's gradient through untouched. The base layer and
`lora_A` are called as modules, as peft calls them, so their hooks run and `fastqwen_fp8`'s FP8 base
runs inside. The math is peft's; the adapter's product is rounded once, in the GEMM's accumulator.
(An autograd function that also accumulates the two input gradients in one GEMM saved 6-11% more GPU
time per layer at the 27B shapes, but its Python backward cost more host time than that on the
35B-A3B at 24 layers on an H100: benchmarks/h100/2026-12-06g.)

Installed per instance, beneath accelerate's hook, at the first forward (adapters may come after
the patch: Axolotl applies LoRA after the plugin patches). Each call checks that the layer is the
plain case: one active unmerged adapter (its `lora_dropout` applied to the adapter's input, as peft
does), no DoRA or other variant, no LoRA bias, no `fan_in_fan_out`, and either autocast or one dtype
for the input and the adapter; anything else (mixed-adapter batches, merged or disabled adapters,
fp32 adapters without autocast) runs peft's own forward, and the report counts both. Layers
Axolotl's LoRA kernels patch (its `lora_*_kernel`) never call this forward: those kernels do the same
fusion. Under FSDP or DeepSpeed (which gather `lora_B`'s weight only when its own module runs) it is
off (`integration/settings.py`).
"""

from __future__ import annotations

from collections import Counter

import torch
from torch import nn

from .instance_forward import replace_forward, restore_forward
from .lora_weight_copies import LoraWeightCopies

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

    def __init__(self, module: nn.Module, original, counts: Counter, copies: LoraWeightCopies):
        self.module, self.original, self.counts, self.copies = module, original, counts, copies

    def __call__(self, x, *args, **kwargs):
        if torch.compiler.is_compiling():  # a compiled graph fuses peft's ops itself; no Python-side count in it
            return self.original(x, *args, **kwargs)
        adapter, why = self._plain(x, args, kwargs)
        if adapter is None:
            self.counts[why] += 1
            return self.original(x, *args, **kwargs)
        self.counts["fused"] += 1
        copies = None
        if torch.is_autocast_enabled(x.device.type):
            m = self.module
            copies = self.copies.get(m, adapter, torch.get_autocast_dtype(x.device.type), m.lora_A[adapter].weight,
                                     m.lora_B[adapter].weight)
        return add_adapter(self.module, adapter, x, copies)

    def _plain(self, x, args, kwargs) -> tuple[str | None, str | None]:
        """(the adapter to fuse, None), or (None, why peft's forward runs instead)."""
        m = self.module
        if args or kwargs:
            return None, "called with more than the input (e.g. adapter_names: a mixed-adapter batch)"
        adapter, why = plain_case(m)
        if adapter is None:
            return None, why
        if not torch.is_autocast_enabled(x.device.type) and not (
                x.dtype == m.lora_A[adapter].weight.dtype == m.lora_B[adapter].weight.dtype):
            return None, "adapter and input dtypes differ without autocast"
        return adapter, None


def plain_case(m: nn.Module) -> tuple[str | None, str | None]:
    """What the fused forward computes, whatever the input: (the layer's one active adapter, None), or
    (None, why not)."""
    if m.disable_adapters or m.merged:
        return None, "adapters disabled or merged"
    active = m.active_adapters
    if len(active) != 1 or active[0] not in m.lora_A:
        return None, "not exactly one active adapter on the layer"
    adapter = active[0]
    if (m.use_dora.get(adapter) or getattr(m, "lora_variant", {}).get(adapter) is not None
            or m.lora_bias.get(adapter) or m.fan_in_fan_out):
        return None, "a LoRA variant (DoRA, ...), lora_bias or fan_in_fan_out"
    return adapter, None


def add_adapter(module: nn.Module, adapter: str, x: torch.Tensor, copies=None) -> torch.Tensor:
    """`base(x) + s·B(A(x))` of a peft LoRA `Linear`, the adapter's product added by its GEMM.

    The layer runs on the rows as a matrix, so that the base's output is a `[tokens, out]` tensor of its
    own: the GEMM then adds into it in place (`addmm_`). Out of place, `torch.addmm` first copies its
    `self` into a new output, a full-size pass (5.2 ms of a 306 ms step on the 35B-A3B at 24 layers,
    benchmarks/h100/2026-12-06h). Nothing holds the base's output for backward (a linear saves its
    input), so autograd takes the in-place add. A base whose output is a view (an FP8 base's, cut from
    its padded GEMM output) gets the out-of-place add. In place, autocast does not cast: the operands
    are cast to the output's dtype, as autocast's `addmm` casts them.

    `copies`: `(A, s·B)` already in the compute dtype (`lora_weight_copies.py`), multiplied as they are
    (alpha 1); None: the layer's own weights, cast here and scaled by the GEMM."""
    rows = x.reshape(-1, x.shape[-1])
    result = module.base_layer(rows)
    dropped = module.lora_dropout[adapter](rows)  # peft's order: the same dropout mask
    if copies is not None and copies[0].dtype == result.dtype:
        low, b, scaling = torch.nn.functional.linear(dropped, copies[0]), copies[1], 1
    else:
        low = module.lora_A[adapter](dropped)
        b, scaling = module.lora_B[adapter].weight, module.scaling[adapter]
    if result._base is None:
        out = result.addmm_(low.to(result.dtype), b.t().to(result.dtype), alpha=scaling)
    else:
        out = torch.addmm(result, low, b.t(), alpha=scaling)
    return out.view(*x.shape[:-1], out.shape[-1])


class FusedLora:
    """Installs `FusedLoraForward` on every peft LoRA `Linear` at the first forward; `restore` takes
    them off. Before each forward of the decoders, `update` also casts the compute-dtype copies of
    their layers' adapters (`lora_weight_copies.py`)."""

    def __init__(self, model: nn.Module, decoders: list[nn.Module] = ()):
        self.model = model
        self.decoders = list(decoders)
        self.layers: list[nn.Module] | None = None
        self.decoder_layers: list[nn.Module] = []  # the layers inside the decoders: the copies' scope
        self.counts: Counter = Counter()  # calls fused, and calls by why peft's forward ran
        self.copies = LoraWeightCopies()

    def update(self, device_type: str | None = None) -> None:
        if self.layers is None:
            self.layers = peft_linear_layers(self.model)
            for module in self.layers:
                replace_forward(module, KEY, lambda original, module=module: FusedLoraForward(
                    module, original, self.counts, self.copies))
            inside = {id(m) for d in self.decoders for m in d.modules()}
            self.decoder_layers = [m for m in self.layers if id(m) in inside]
        if device_type is not None:
            entries = []
            if torch.is_autocast_enabled(device_type):
                dtype = torch.get_autocast_dtype(device_type)
                for m in self.decoder_layers:
                    adapter = plain_case(m)[0]
                    if adapter is not None and not _hooked(m.lora_A[adapter]):
                        entries.append((m, adapter, m.lora_A[adapter].weight, m.lora_B[adapter].weight,
                                        m.scaling[adapter], dtype))
            self.copies.refresh(entries, device_type)

    def restore(self) -> None:
        for module in self.layers or []:
            restore_forward(module, KEY)
        self.layers = None
        self.decoder_layers = []
        self.copies = LoraWeightCopies()

    def fused_layers(self, layers) -> int:
        """How many of `layers` carry the fused forward."""
        mine = {id(m) for m in self.layers or []}
        return sum(id(m) in mine for m in layers or [])

    def to_dict(self) -> dict:
        """Layers found, calls fused, and calls by why peft's forward ran (read live by the report)."""
        return {"layers": len(self.layers or []), "fused_calls": self.counts["fused"],
                "peft_calls": {why: n for why, n in self.counts.most_common() if why != "fused"},
                "weight_copies": self.copies.to_dict()}


def _hooked(lora_a: nn.Module) -> bool:
    """Hooks on `lora_A` run only when it is called: a layer with any multiplies its own weight (the
    copy would skip the call)."""
    return bool(lora_a._forward_hooks or lora_a._forward_pre_hooks or hasattr(lora_a, "_hf_hook")
                or "forward" in lora_a.__dict__)
