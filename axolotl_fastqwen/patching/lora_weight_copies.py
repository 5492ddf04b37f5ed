"""LoRA factors in the compute dtype, cast once a forward, all together: the fused LoRA layers'
(`fused_lora.py`) and the factored expert LoRA's (`expert_lora.py`, each wrapper's `A` and `s·B` cast
to the experts' weight dtype, where each call cast both and scaled the `[rows, rank]` product).

peft keeps adapters in fp32 (`autocast_adapter_dtype=True`) and the Trainer runs under bf16 autocast,
so every adapted layer, in every forward and every recompute, casts `lora_A` and `lora_B` to bf16
(2 launches), autograd casts both gradients back to fp32 (2 more: `ToCopyBackward0`), and the
adapter's scaling multiplies both gradients of the fused `addmm` (`AddmmBackward0`'s alpha: 2 more).
On the 35B-A3B at 24 layers that was ~800 of the step's 6,700 launches (census of
benchmarks/h100/2026-12-06h), each a few microseconds of GPU and of a host that the MoE step waits on.

Here, before the decoder's first layer, one autograd function casts every plain fused layer's `A` and
`s·B` (the scaling folded into B) to the autocast dtype with multi-tensor kernels (`torch._foreach_*`:
a few launches for hundreds of tensors), and its backward, once autograd has every layer's gradients,
casts them back and scales B's the same way. The layers read those copies; the `addmm` runs with
alpha 1. With a power-of-two scaling (lora_alpha = 2r, Axolotl's usual) every bit is the per-layer
cast's: `s·B` rounds as `B` does. Otherwise `s·B` is rounded once to bf16 where before the product was
scaled in the GEMM's fp32 epilogue: one rounding either way.

Cast in training forwards under autocast with adapters in another dtype (an eval forward reads the
last ones), for the decoder's layers only (their weights cannot change between the decoder's pre-hook
and their calls; a vision tower's layers run before it) and only for layers called as peft calls them
(no hooks on `lora_A`). A copy is used only while its weights' version counters are those it was cast
at: after the optimizer's step, never. Under reentrant checkpointing the backward runs once a recomputed
layer, with that layer's gradients. Off with several processes (DDP reduces each gradient as it is
ready; one node producing them all at the end would delay that overlap) and under `torch.compile`
(which fuses the casts itself).
"""

from __future__ import annotations

import torch
from torch import nn


class CastForCompute(torch.autograd.Function):
    """`(w_1 · s_1, ..., w_n · s_n)` in `dtypes` (one, or one a weight), forward and backward in
    multi-tensor kernels."""

    @staticmethod
    def forward(ctx, dtypes, scales: tuple[float, ...], *weights: torch.Tensor):
        ctx.scales = scales
        ctx.dtypes = [w.dtype for w in weights]  # the gradients go back in the weights' own dtypes
        ctx.set_materialize_grads(False)  # a layer that did not run sends None: nothing to cast
        return tuple(cast_scaled(list(weights), scales, dtypes, stacked=True))

    @staticmethod
    def backward(ctx, *grads):
        present = [i for i, g in enumerate(grads) if g is not None and ctx.needs_input_grad[2 + i]]
        out: list[torch.Tensor | None] = [None] * len(grads)
        if present:
            cast = cast_scaled([grads[i] for i in present], [ctx.scales[i] for i in present],
                               [ctx.dtypes[i] for i in present])
            for i, g in zip(present, cast):
                out[i] = g
        return (None, None, *out)


def cast_scaled(tensors: list[torch.Tensor], scales, dtypes, *, stacked: bool = False) -> list[torch.Tensor]:
    """`t · s` in `dtypes` (one dtype, or one per tensor) for each `t, s`; the scale is applied in the
    wider of the two dtypes (fp32 here), then rounded once. Multi-tensor kernels throughout.

    `stacked`: tensors of one shape and dtype get views of one buffer (one allocation a shape, not
    one a tensor: a 64-layer model has hundreds of adapters and a handful of shapes)."""
    if isinstance(dtypes, torch.dtype):
        dtypes = [dtypes] * len(tensors)
    out = _stacked_empty(tensors, dtypes) if stacked else [
        torch.empty(t.shape, dtype=d, device=t.device) for t, d in zip(tensors, dtypes)]
    scaled = [i for i, s in enumerate(scales) if s != 1]
    wide = [i for i in scaled if out[i].element_size() > tensors[i].element_size()]  # scale after widening
    narrow = sorted(set(scaled) - set(wide))
    sources = list(tensors)
    if narrow:  # scale in the source's (wider) dtype, then cast
        for i, t in zip(narrow, torch._foreach_mul([tensors[i] for i in narrow], [scales[i] for i in narrow])):
            sources[i] = t
    torch._foreach_copy_(out, sources)
    if wide:
        torch._foreach_mul_([out[i] for i in wide], [scales[i] for i in wide])
    return out


def _stacked_empty(tensors: list[torch.Tensor], dtypes: list[torch.dtype]) -> list[torch.Tensor]:
    groups: dict[tuple, list[int]] = {}
    for i, (t, d) in enumerate(zip(tensors, dtypes)):
        groups.setdefault((tuple(t.shape), d, t.device), []).append(i)
    out: list[torch.Tensor | None] = [None] * len(tensors)
    for (shape, dtype, device), members in groups.items():
        for i, view in zip(members, torch.empty((len(members), *shape), dtype=dtype, device=device).unbind(0)):
            out[i] = view
    return out


NO_GRADIENTS = "not a training forward (no gradients)"
# set on a module whose forward a CUDA graph replays (`moe_cuda_graphs.py`): a callable, True while the module must
# cast its factors itself. The copies' one backward node would otherwise hold its factors' gradient accumulators,
# made on the default stream, and the graph's backward capture, on its own stream, would wait on that stream.
CASTS_ITSELF = "_fastqwen_casts_itself"


def casts_itself(module: nn.Module) -> bool:
    says = module.__dict__.get(CASTS_ITSELF)
    return bool(says is not None and says())


class LoraWeightCopies:
    """Per training forward: compute-dtype copies of LoRA factors, `(A, s·B)` under a module's id.

    `needs_autocast`: peft's LoRA `Linear`s compute in autocast's dtype, so without autocast nothing is
    cast; the factored expert LoRA casts to the experts' weight dtype (grouped GEMMs are not autocast
    ops), autocast or not."""

    def __init__(self, needs_autocast: bool = True):
        self.needs_autocast = needs_autocast
        self.copies: dict[int, tuple[str, torch.Tensor, torch.Tensor, int, int]] = {}
        self.state = "not yet decided (first training forward)"
        self.layers = 0
        self.bytes = 0
        self.forwards = 0

    def refresh(self, entries: list[tuple[nn.Module, str, torch.Tensor, torch.Tensor, float, torch.dtype]],
                device_type: str) -> None:
        """Cast the copies for this forward: `(module, adapter, A, B, scaling, dtype)` each, `A` and `s·B`
        in `dtype` (or drop them all, and say why)."""
        why = self._why_not(device_type)
        if why == NO_GRADIENTS:  # an eval forward: the last training forward's copies and verdict stay
            return
        self.copies = {}
        if why is not None:
            self.state = why
            return
        chosen = [e for e in entries if not (e[2].dtype == e[5] and e[3].dtype == e[5])  # else nothing is cast
                  and not casts_itself(e[0])]
        if not chosen:
            self.state = "unused: every adapter is in its compute dtype already"
            return
        weights = [w for _, _, a, b, _, _ in chosen for w in (a, b)]
        scales = tuple(s for *_, scaling, _ in chosen for s in (1.0, float(scaling)))
        dtypes = tuple(d for *_, dtype in chosen for d in (dtype, dtype))
        if torch.is_grad_enabled() and any(w.requires_grad for w in weights):
            cast = CastForCompute.apply(dtypes, scales, *weights)
        else:
            with torch.no_grad():
                cast = cast_scaled(weights, scales, list(dtypes), stacked=True)
        for k, (module, adapter, a, b, _, _) in enumerate(chosen):
            self.copies[id(module)] = (adapter, cast[2 * k], cast[2 * k + 1], a._version, b._version)
        self.layers = len(chosen)
        self.bytes = sum(t.numel() * t.element_size() for t in cast)
        self.forwards += 1
        self.state = "on"

    def _why_not(self, device_type: str) -> str | None:
        if torch.compiler.is_compiling():
            return "off: under torch.compile (the compiled graph fuses the casts)"
        if self.needs_autocast and not torch.is_autocast_enabled(device_type):
            return "unused: no autocast (the adapters run in their own dtype, nothing is cast)"
        if not torch.is_grad_enabled():
            return NO_GRADIENTS
        if torch.distributed.is_available() and torch.distributed.is_initialized() and \
                torch.distributed.get_world_size() > 1:
            return ("off: several processes (DDP reduces each gradient as it is ready; the copies' gradients "
                    "would all come at the end of the backward)")
        return None

    def get(self, module: nn.Module, adapter: str, dtype: torch.dtype, a: torch.Tensor, b: torch.Tensor):
        """`(A, s·B)` for this call of `module` with factors `a`, `b`, or None: no copy, another adapter or
        dtype, the factors changed since (their version counters: the optimizer's step), or a CUDA graph is
        being captured (the graph casts the factors itself; a replayed block's modules are never copied:
        `CASTS_ITSELF`)."""
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return None  # a CUDA graph (patching/moe_cuda_graphs.py) would replay this forward's copies forever
        entry = self.copies.get(id(module))
        if entry is None or entry[0] != adapter or entry[1].dtype != dtype:
            return None
        if a._version != entry[3] or b._version != entry[4]:
            return None
        return entry[1], entry[2]

    def to_dict(self) -> dict:
        return {"state": self.state, "layers": self.layers, "bytes": self.bytes, "forwards": self.forwards}
