"""`fastqwen_checkpoint_offload`: the inputs of recomputed decoder layers in host memory.

Gradient checkpointing keeps one tensor per recomputed decoder layer, its input `[tokens, hidden]`:
at the 27B shape 10 KiB a token a layer, 20 GiB over 64 layers at 32k tokens and 80 GiB at 128k,
which is what stops long rows first (issue 37). This moves each to pinned host memory while its
layer computes, and brings it back one layer ahead in backward, so both copies run beside the
compute instead of in front of it:

- forward: the checkpoint function's own saved inputs are seen through saved-tensor hooks set
  around each layer's checkpoint function; torch's checkpoint pushes its own hooks beneath them for
  the layer's inner tensors, so nothing else moves. The copy to host runs on a side stream, and the
  device tensor's memory is not reused before it is done (`record_stream`).
- backward: restoring layer i's input starts the copy of layer i-1's on the side stream, which the
  recompute of layer i then overlaps; the compute stream waits on its event only when it needs it.
- layers whose activations are kept (`fastqwen_checkpointing: auto`) call no checkpoint function:
  nothing of theirs moves, so auto keeps what fits, and the rest is recomputed from host memory.
- host buffers are pinned once and reused: a buffer is free again only when autograd drops the
  saved input (after its backward), so several forwards before one backward stay correct; beyond
  `host_limit` (by default `HOST_FRACTION` of the host's memory), inputs stay on the device
  (counted in the report).

`auto` (the plugin's default) moves nothing until a training forward's checkpointed inputs would
take the device past `AUTO_FRACTION` of its memory beside what is already allocated (the weights,
the optimizer's state, the batch): where they fit, the copies would only cost PCIe time and pinned
host memory; where they do not, the row would run out of memory (the 27B at 32k-token rows on an
80 GB card: 50 GiB of weights and 20 GiB of inputs). Once on, it stays on.

Axolotl's `activation_offloading: hidden_states` is the peer: it marks each checkpointed layer's
input by `id()` and restores it when the recompute asks, with the compute stream waiting for the
copy (no prefetch).
"""

from __future__ import annotations

import os
import weakref
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

MIN_BYTES = 1 << 20  # smaller saved inputs stay where they are: a copy costs more than it frees
HOST_FRACTION = 0.5  # of the host's physical memory, at most, pinned for layer inputs
# `auto` turns on where allocated memory plus the checkpointed inputs would pass this share of the device:
# the rest is the room one layer's recompute and backward need (13 GiB of an 80 GB card for the 27B at
# 32k tokens, H100, benchmarks/h100/2026-12-06f)
AUTO_FRACTION = 0.75


def host_memory_bytes() -> int:
    """The host's physical memory."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def cuda_memory(device: torch.device) -> tuple[int, int] | None:
    """(bytes allocated by PyTorch, the device's total) on a CUDA device (host-side counters, no sync);
    None elsewhere: a CPU's tensors are in host memory already."""
    if device.type != "cuda":
        return None
    return torch.cuda.memory_allocated(device), torch.cuda.get_device_properties(device).total_memory


class _Offloaded:
    """One saved layer input that lives in host memory; its buffer goes back to the pool when
    autograd drops it."""

    __slots__ = ("owner", "buffer", "device", "order", "index", "prefetched", "__weakref__")

    def __init__(self, owner: CheckpointOffload, buffer: torch.Tensor, device: torch.device, order: list, index: int):
        self.owner, self.buffer, self.device, self.order, self.index = owner, buffer, device, order, index
        self.prefetched: tuple[torch.Tensor, object] | None = None  # (device tensor, its copy's event)

    def __del__(self):
        owner = self.owner
        if owner is not None:
            owner._release(self.buffer)


@dataclass
class OffloadStats:
    offloaded: int = 0  # layer inputs moved to host memory
    offloaded_bytes: int = 0
    restored: int = 0
    prefetched: int = 0  # restores whose copy had started one layer ahead
    kept_on_device: int = 0  # inputs left on the device: host limit reached
    host_bytes: int = 0  # pinned buffers held (reused every step)


@dataclass
class CheckpointOffload:
    """The offload of one model's decoder layers; `sync_layers()` before each forward (the decoder's
    pre-hook does) wraps any checkpoint function the trainer set since."""

    layers: list[nn.Module]
    devices: tuple[str, ...] = ("cuda",)
    min_bytes: int = MIN_BYTES
    host_limit: int = field(default_factory=lambda: int(HOST_FRACTION * host_memory_bytes()))
    auto: bool = False  # move nothing until a forward's inputs would crowd the device (`decide`)
    device_memory: object = cuda_memory  # device -> (allocated, total) bytes or None, for `auto`
    active: bool | None = None  # moving inputs now (always, unless `auto` has not turned it on)
    why: str | None = None  # `auto`'s last verdict, for the report
    stats: OffloadStats = field(default_factory=OffloadStats)
    _free: dict[tuple, list[torch.Tensor]] = field(default_factory=dict)
    _order: list = field(default_factory=list)  # this forward's offloaded inputs, in order (weakrefs)
    _order_bytes: int = 0  # what they hold (the handles die with their backward; this stays for the report)
    _stream: object = None

    def __post_init__(self):
        if self.active is None:
            self.active = not self.auto

    # ---- installation -----------------------------------------------------------------------
    def sync_layers(self) -> None:
        """Wrap each layer's checkpoint function (transformers sets it on every layer in
        `gradient_checkpointing_enable`, which trainers call after the model is patched); start a
        new forward's order."""
        self._order, self._order_bytes = [], 0
        for layer in self.layers:
            func = layer.__dict__.get("_gradient_checkpointing_func")
            if func is not None and not isinstance(func, _OffloadingCheckpoint):
                layer._gradient_checkpointing_func = _OffloadingCheckpoint(func, self)

    def decide(self, layer_input_bytes: int, device: torch.device) -> bool:
        """`auto`: turn on (for good) if this training forward's checkpointed inputs, `layer_input_bytes`
        per layer whose checkpointing is on, would take allocated memory past `AUTO_FRACTION` of the
        device. Returns whether the offload is on."""
        if self.active:
            return True
        if device.type not in self.devices:
            self.why = f"off: nothing to move on {device.type}"
            return False
        recomputed = sum(1 for layer in self.layers if getattr(layer, "gradient_checkpointing", False)
                         and layer.__dict__.get("_gradient_checkpointing_func") is not None)
        if not recomputed:
            self.why = "off: no layer is recomputed"
            return False
        memory = self.device_memory(device)
        if memory is None:
            self.why = f"off: no device memory to spare on {device.type}"
            return False
        allocated, total = memory
        inputs = recomputed * layer_input_bytes
        verdict = (f"{recomputed} recomputed layers' inputs, {inputs / 1024**3:.1f} GiB, beside "
                   f"{allocated / 1024**3:.1f} GiB allocated")
        limit = AUTO_FRACTION * total
        self.active = allocated + inputs > limit
        self.why = (f"on: {verdict} would pass {AUTO_FRACTION:.0%} of the device's {total / 1024**3:.1f} GiB"
                    if self.active else f"off: {verdict} stay under {AUTO_FRACTION:.0%} of the device's "
                                        f"{total / 1024**3:.1f} GiB")
        return self.active

    def restore(self) -> None:
        """Each layer's own checkpoint function back."""
        for layer in self.layers:
            func = layer.__dict__.get("_gradient_checkpointing_func")
            if isinstance(func, _OffloadingCheckpoint):
                layer._gradient_checkpointing_func = func.original
        self._free.clear()
        self.stats.host_bytes = 0

    # ---- the hooks --------------------------------------------------------------------------
    def pack(self, tensor: torch.Tensor):
        if (not self.active or tensor.device.type not in self.devices or isinstance(tensor, nn.Parameter)
                or tensor.numel() * tensor.element_size() < self.min_bytes or not tensor.is_contiguous()):
            return tensor
        buffer = self._buffer_like(tensor)
        if buffer is None:
            self.stats.kept_on_device += 1
            return tensor
        stream = self._side_stream(tensor.device)
        if stream is None:
            buffer.copy_(tensor)
        else:
            stream.wait_stream(torch.cuda.current_stream(tensor.device))
            with torch.cuda.stream(stream):
                buffer.copy_(tensor, non_blocking=True)
            tensor.record_stream(stream)  # its memory is not reused before the copy is done
        handle = _Offloaded(self, buffer, tensor.device, self._order, len(self._order))
        self._order.append(weakref.ref(handle))
        size = buffer.numel() * buffer.element_size()
        self._order_bytes += size
        self.stats.offloaded += 1
        self.stats.offloaded_bytes += size
        return handle

    def unpack(self, saved):
        if not isinstance(saved, _Offloaded):
            return saved
        self.stats.restored += 1
        if saved.prefetched is not None:
            tensor, event = saved.prefetched
            saved.prefetched = None
            self.stats.prefetched += 1
            if event is not None:
                torch.cuda.current_stream(saved.device).wait_event(event)
        else:
            tensor, event = self._copy_back(saved)
            if event is not None:
                torch.cuda.current_stream(saved.device).wait_event(event)
        if saved.index > 0:  # backward runs the layers in reverse: the one before is next
            before = saved.order[saved.index - 1]()
            if before is not None and before.prefetched is None:
                before.prefetched = self._copy_back(before)
        return tensor

    # ---- copies and buffers -----------------------------------------------------------------
    def _copy_back(self, saved: _Offloaded) -> tuple[torch.Tensor, object]:
        stream = self._side_stream(saved.device)
        if stream is None:
            return saved.buffer.to(saved.device, copy=True), None
        compute = torch.cuda.current_stream(saved.device)
        tensor = torch.empty(saved.buffer.shape, dtype=saved.buffer.dtype, device=saved.device)  # compute's pool
        stream.wait_stream(compute)  # the memory may have been freed by work still queued there
        with torch.cuda.stream(stream):
            tensor.copy_(saved.buffer, non_blocking=True)
            event = stream.record_event()
        tensor.record_stream(stream)  # a prefetch dropped unused must not free memory still being written
        return tensor, event

    def _buffer_like(self, tensor: torch.Tensor) -> torch.Tensor | None:
        key = (tuple(tensor.shape), tensor.dtype)
        free = self._free.get(key)
        if free:
            return free.pop()
        size = tensor.numel() * tensor.element_size()
        if self.stats.host_bytes + size > self.host_limit:
            return None
        self.stats.host_bytes += size
        return torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu",
                           pin_memory=tensor.device.type == "cuda")

    def _release(self, buffer: torch.Tensor) -> None:
        # a later copy into this buffer is queued on the same side stream as the copy out of it
        self._free.setdefault((tuple(buffer.shape), buffer.dtype), []).append(buffer)

    def _side_stream(self, device: torch.device):
        if device.type != "cuda":
            return None
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        return self._stream

    def to_dict(self) -> dict:
        s = self.stats
        return {"mode": "auto" if self.auto else "on", "active": self.active, "why": self.why,
                "last_forward_inputs": len(self._order), "last_forward_bytes": self._order_bytes,
                "last_forward_gib": round(self._order_bytes / 1024**3, 3),
                "offloaded_inputs": s.offloaded, "offloaded_gib": round(s.offloaded_bytes / 1024**3, 3),
                "restored": s.restored, "prefetched": s.prefetched, "kept_on_device": s.kept_on_device,
                "pinned_host_gib": round(s.host_bytes / 1024**3, 3),
                "host_limit_gib": round(self.host_limit / 1024**3, 1), "layers": len(self.layers)}


class _OffloadingCheckpoint:
    """A layer's checkpoint function, run with the offload's saved-tensor hooks around it."""

    def __init__(self, original, owner: CheckpointOffload):
        self.original, self.owner = original, owner

    def __call__(self, function, *args, **kwargs):
        hooks = saved_tensors_hooks(self.owner.pack, self.owner.unpack) if torch.is_grad_enabled() else nullcontext()
        with hooks:
            return self.original(function, *args, **kwargs)
