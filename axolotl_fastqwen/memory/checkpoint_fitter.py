"""`fastqwen_checkpointing: auto`: recompute only the layers that do not fit in memory.

Gradient checkpointing recomputes every decoder layer's forward during backward; with LoRA that
is about a third of the step's work. The packer's rows have one static shape, so a step's memory
is the same every step, and it can be measured instead of guessed:

1. two steps with every layer recomputed: the second's peak (optimizer state included) is the base;
   if keeping one pattern period could take more than the room under the limit (bounded by
   `KEPT_LAYER_INPUTS` times a layer's input each), nothing is probed and every layer recomputes;
2. a probe step that keeps the activations of the last pattern period (3 Gated DeltaNet + 1
   attention layer on Qwen3.5), measuring what each layer's forward leaves allocated: a kept layer
   holds its saved activations, a recomputed one only its output. Their difference, summed over
   the period, is what one more kept period costs. The step's peak alone cannot say it: the base
   peak may come from another phase of the step (the loss, the optimizer), which kept activations
   first fill up to (measured on the H200: the probe raised the peak by 4.3 GiB for 4 layers that
   hold 1.4 GiB each, and a fit on that slope ran out of memory);
3. as many periods kept as `base + periods x cost` allows under `fastqwen_checkpointing_memory` of
   the device: an upper bound, since kept activations add at most their size to any moment;
4. the fitted step's own peak is then the new base: as many more periods are kept as still fit
   under the limit at the measured cost (the probe's base peak comes from another phase of the
   step, so the bound of 3. leaves room: on the H200, 27B, 64 layers, 44 layers kept peaked
   6.4 GiB under a 125.8 GiB limit, and 48 then peaked at 125.1);
5. every later step is watched: a step whose peak goes over the limit gives one period back, and
   so does a settled step in which the allocator had to flush its cache and retry an allocation
   (a device-wide stall; none was seen on the H200: 0.85 with either allocator, 0.90 with
   expandable segments; fragmentation near a higher limit would cost more than 4 recomputed layers).

The last layers are the ones kept, so their activations are freed before the recomputed layers
start their own. The switch is transformers' own per-layer `gradient_checkpointing` flag
(`GradientCheckpointingLayer`), so it composes with whatever checkpoint function the trainer
installed, and `restore()` puts every flag back.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from .. import registry
from ..families.base import detect_family, unwrap
from . import graph_pools

LOG = logging.getLogger("axolotl_fastqwen")
GIB = 1024**3
# the peak *allocated* may reach this fraction of the GPU's memory; the rest is left to the
# allocator's cache, fragmentation and other processes (`fastqwen_checkpointing_memory`). Measured
# on the H200 (benchmarks/h200/2026-12-04b): 0 allocator retries at 0.85 (either allocator) and at
# 0.90 (expandable segments); 27B, 64 layers: peak 125.1 GiB (89.5% of the card) at 0.90.
DEFAULT_CHECKPOINTING_MEMORY = 0.90
# what one kept decoder layer holds, in multiples of its input `[tokens, hidden]`: an upper bound that
# decides whether the probe can run at all (measured on the 27B at 16k tokens, H100: 3.41 GiB a
# layer with lean activations against a 0.156 GiB input, 21.8x; 17.6% more without lean). A probe
# that did not fit ran out of memory at 32k tokens on an H100 before the fit could give it back.
KEPT_LAYER_INPUTS = 24
SETTLE_STEPS = 2  # steps at full recompute before the baseline: the first step creates the optimizer's state
FIT_STEPS = SETTLE_STEPS + 3  # + the probe step, the step that checks the fit, one that checks a grown fit


class DeviceMemory(Protocol):
    """Memory readings of the training device: now, and the peak since the last reset."""

    def total(self) -> int: ...
    def allocated(self) -> int: ...
    def reset_peak(self) -> None: ...
    def peak(self) -> int: ...
    def retries(self) -> int: ...


class CudaMemory:
    """The CUDA caching allocator's counters: reading them costs no device sync."""

    def __init__(self, device: torch.device):
        self.device = device

    def total(self) -> int:
        return torch.cuda.get_device_properties(self.device).total_memory

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> int:
        """The allocated peak, plus what CUDA graph pools hold beside it (graph_pools.py)."""
        return torch.cuda.max_memory_allocated(self.device) + graph_pools.aside_bytes()

    def retries(self) -> int:
        """Allocations so far that failed, flushed the cache and retried (a device sync each)."""
        return int(torch.cuda.memory_stats(self.device).get("num_alloc_retries", 0))


def memory_of(device: torch.device) -> DeviceMemory | None:
    """The device's memory counters; None where there are none (CPU)."""
    return CudaMemory(device) if device.type == "cuda" else None


def decoder_layers(model: nn.Module) -> tuple[list[nn.Module], int]:
    """The text decoder's layer stack, and its pattern period (layers up to and including the first
    full-attention layer: 4 on Qwen3.5 / Qwen3-Next)."""
    base = unwrap(model)
    plan = detect_family(base, registry.families())
    decoder = next((m for m in base.modules() if type(m) in plan.decoder), None)
    if decoder is None or not isinstance(getattr(decoder, "layers", None), nn.ModuleList):
        raise RuntimeError(f"{type(base).__name__}: no decoder layer stack of {plan.family.decoder} found")
    types = list(getattr(decoder.config, "layer_types", None) or [])
    period = types.index("full_attention") + 1 if "full_attention" in types else 1
    return list(decoder.layers), period


@dataclass
class Decision:
    step: int
    kept_layers: int
    peak_gib: float | None
    why: str


class CheckpointFitter:
    """Keeps the activations of as many decoder layers as fit; call `step_begin` / `step_end`
    around every optimizer step (the plugin's trainer callback and the bench do)."""

    def __init__(self, model: nn.Module, memory: DeviceMemory | None, *,
                 fraction: float = DEFAULT_CHECKPOINTING_MEMORY):
        if not 0.0 < fraction < 1.0:
            raise ValueError(f"the memory fraction must be in (0, 1), got {fraction}")
        self.layers, self.period = decoder_layers(model)
        self.memory = memory
        self.fraction = fraction
        self.limit = int(fraction * memory.total()) if memory is not None else 0
        self.step = 0
        self.kept = 0
        self.phase = "settling"  # settling -> probing -> fitted -> settled | off
        self.base_peak: int | None = None
        self.period_bytes: int | None = None
        self.decisions: list[Decision] = []
        self.off_reason: str | None = None
        self.layer_bytes: dict[str, list[int]] | None = None  # the probe's growth: kept layers / a recomputed one
        self._turned_off: list[nn.Module] = []
        self._growth: dict[int, int] = {}
        self._hooks: list = []
        self._retries_at_begin = 0
        self.retries_seen = 0  # allocator retries in settled steps (each gave a period back)
        self.ceiling: int | None = None  # a kept count that went over the limit or stalled: never again
        self.input_bytes = 0  # the largest decoder-layer input seen while settling
        if memory is None:
            self._stop("no CUDA device: its peak memory cannot be measured")
        elif not any(getattr(layer, "gradient_checkpointing", False) for layer in self.layers):
            self._stop("gradient checkpointing is not on for the decoder layers: nothing is recomputed")

    # ---- the loop -------------------------------------------------------------------------
    def step_begin(self) -> None:
        if self.phase == "off":
            return
        self.memory.reset_peak()
        self._retries_at_begin = self.memory.retries()
        if self.phase == "probing":
            self._watch_layers()
        elif self.phase == "settling" and not self._hooks:
            self._hooks.append(self.layers[0].register_forward_pre_hook(self._record_input, with_kwargs=True))

    def step_end(self) -> None:
        if self.phase == "off":
            return
        self.step += 1
        peak = self.memory.peak()
        if self.phase == "settling":
            if self.step >= SETTLE_STEPS:
                self.base_peak = peak
                if peak > self.limit:
                    self._stop(f"the peak with every layer recomputed, {peak / GIB:.1f} GiB, is already over the "
                               f"limit ({self.limit / GIB:.1f} GiB)", peak)
                    return
                self._unwatch_layers()
                probe = min(self.period, len(self.layers))
                guess = probe * KEPT_LAYER_INPUTS * self.input_bytes
                if peak + guess > self.limit:
                    self._stop(f"the peak with every layer recomputed, {peak / GIB:.1f} GiB, leaves "
                               f"{(self.limit - peak) / GIB:.1f} GiB under the limit, and keeping {probe} layers of "
                               f"{self.input_bytes / GIB:.2f} GiB inputs may take up to {guess / GIB:.1f} GiB: "
                               "not probed", peak)
                    return
                self.phase = "probing"
                self._keep(probe, peak, "probe: keep one pattern period")
            return
        if self.phase == "probing":
            self._unwatch_layers()
            measured = self._period_cost()
            self.period_bytes = max(measured, peak - self.base_peak)
            if peak > self.limit or self.period_bytes <= 0:
                why = (f"keeping {self.kept} layers peaked at {peak / GIB:.1f} GiB, over the limit" if peak > self.limit
                       else f"keeping {self.kept} layers allocated nothing more ({peak / GIB:.2f} GiB): cannot size")
                self._keep(0, peak, why)
                self._stop(why, peak)
                return
            periods = int((self.limit - self.base_peak) // self.period_bytes)
            self.phase = "fitted"
            self._keep(periods * self.period, peak,
                       f"{self.period_bytes / GIB:.2f} GiB per {self.period} layers kept (held after their forward: "
                       f"{measured / GIB:.2f}; the peak rose {(peak - self.base_peak) / GIB:.2f}); base "
                       f"{self.base_peak / GIB:.1f} GiB, limit {self.limit / GIB:.1f} GiB")
            return
        if peak > self.limit:
            self._give_back(peak, f"peak {peak / GIB:.1f} GiB over the limit {self.limit / GIB:.1f} GiB")
            return
        retried = self.memory.retries() - self._retries_at_begin
        if retried and self.phase == "settled" and self.kept:
            # the step after a change may re-lay the cache once; a settled step must not stall
            self.retries_seen += retried
            self._give_back(peak, f"the allocator flushed its cache and retried {retried} allocation(s) in a "
                                  "settled step (fragmentation near the limit; each is a device-wide stall)")
            return
        if self.phase == "fitted":
            room = self.limit - peak
            most = len(self.layers) if self.ceiling is None else min(len(self.layers), self.ceiling - 1)
            periods = min(int(room // self.period_bytes), max(0, most - self.kept) // self.period)
            more = periods * self.period
            if more:
                self._keep(self.kept + more, peak,
                           f"the step peaked at {peak / GIB:.1f} GiB: {room / GIB:.1f} GiB under the limit leaves "
                           f"room for {more // self.period} period(s) more")
                return
            self.phase = "settled"
            self.decisions.append(Decision(self.step, self.kept, round(peak / GIB, 2), "within the limit"))
            LOG.info("axolotl_fastqwen: checkpointing settled: %s", self.summary())

    # ---- the probe ------------------------------------------------------------------------
    def _watch_layers(self) -> None:
        """Record what each decoder layer's first forward of the step leaves allocated (a
        recomputed layer runs again in backward: that second call is not its forward)."""
        self._growth = {}
        before: dict[int, int] = {}

        def pre(module, args):
            if id(module) not in self._growth:
                before[id(module)] = self.memory.allocated()

        def post(module, args, output):
            if id(module) not in self._growth and id(module) in before:
                self._growth[id(module)] = self.memory.allocated() - before.pop(id(module))

        for layer in self.layers:
            self._hooks += [layer.register_forward_pre_hook(pre), layer.register_forward_hook(post)]

    def _record_input(self, module, args, kwargs) -> None:
        x = args[0] if args else kwargs.get("hidden_states")
        if isinstance(x, torch.Tensor):
            self.input_bytes = max(self.input_bytes, x.numel() * x.element_size())

    def _unwatch_layers(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def _period_cost(self) -> int:
        """Bytes one more kept period holds: each kept layer's growth over a recomputed one's."""
        kept = [self._growth[id(m)] for m in self.layers if id(m) in self._growth and not m.gradient_checkpointing]
        recomputed = sorted(self._growth[id(m)] for m in self.layers
                            if id(m) in self._growth and m.gradient_checkpointing)
        if not kept or not recomputed:
            return 0
        output = recomputed[len(recomputed) // 2]  # what every layer leaves: its output
        self.layer_bytes = {"kept": kept, "recomputed": [output]}
        return sum(max(0, g - output) for g in kept)

    # ---- state ----------------------------------------------------------------------------
    def _keep(self, n: int, peak: int | None, why: str) -> None:
        """Keep the activations of the last `n` decoder layers, recompute the others."""
        n = max(0, min(n, len(self.layers)))
        self.restore()
        for layer in self.layers[len(self.layers) - n:]:
            if layer.gradient_checkpointing:
                layer.gradient_checkpointing = False
                self._turned_off.append(layer)
        self.kept = n
        self.decisions.append(Decision(self.step, n, round(peak / GIB, 2) if peak is not None else None, why))
        LOG.info("axolotl_fastqwen: checkpointing after step %d: activations kept for the last %d of %d layers (%s)",
                 self.step, n, len(self.layers), why)

    def _give_back(self, peak: int, why: str) -> None:
        """One period fewer kept, and the count that failed is never tried again."""
        self.phase, self.ceiling = "fitted", self.kept
        self._keep(max(0, self.kept - self.period), peak, f"{why}: one period back")

    def _stop(self, why: str, peak: int | None = None) -> None:
        self.phase, self.off_reason = "off", why
        self.decisions.append(Decision(self.step, self.kept, round(peak / GIB, 2) if peak is not None else None,
                                       f"every layer recomputed: {why}"))

    def restore(self) -> None:
        """Every flag this fitter turned off back on (and the probe's hooks off)."""
        self._unwatch_layers()
        for layer in self._turned_off:
            layer.gradient_checkpointing = True
        self._turned_off.clear()

    def recomputed_fraction(self) -> float:
        return (len(self.layers) - self.kept) / max(1, len(self.layers))

    def summary(self) -> str:
        if self.phase == "off":
            return f"every layer recomputed ({self.off_reason})"
        n = len(self.layers)
        return (f"activations kept for the last {self.kept} of {n} layers, {n - self.kept} recomputed ({self.phase}, "
                f"limit {self.fraction:.0%} of the device = {self.limit / GIB:.1f} GiB)")

    def to_dict(self) -> dict:
        return {
            "mode": "auto",
            "phase": self.phase,
            "summary": self.summary(),
            "layers": len(self.layers),
            "period": self.period,
            "kept_layers": self.kept,
            "recomputed_layers": len(self.layers) - self.kept,
            "memory_fraction": self.fraction,
            "limit_gib": round(self.limit / GIB, 2),
            "base_peak_gib": round(self.base_peak / GIB, 2) if self.base_peak is not None else None,
            "gib_per_period": round(self.period_bytes / GIB, 3) if self.period_bytes is not None else None,
            "probe_gib_held_per_layer": ({k: [round(b / GIB, 3) for b in v] for k, v in self.layer_bytes.items()}
                                    if self.layer_bytes is not None else None),
            "allocator_retries_in_settled_steps": self.retries_seen,
            "decisions": [vars(d) for d in self.decisions],
        }
