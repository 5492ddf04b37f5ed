"""Lean activations: saved outputs that are cheap to recompute are dropped after the forward.

A decoder layer whose activations are kept (not recomputed by gradient checkpointing) holds, for
its backward, the outputs of its two RMSNorms and of the Gated DeltaNet's gated norm (attention:
its sigmoid output gate), and its MLP's SwiGLU product: the LoRA projections that read them save them
(the A gradient needs its input). Each is a function of tensors its own op saved for its backward
already, so holding it too is redundant: 3.2 hidden sizes per token of the 19.2 that a kept
Qwen3.5-27B layer holds (the H200 probe of `benchmarks/h200/2026-12-05`: 1.494 GiB per layer at 8,192
tokens) for the norms, 3.4 for the product (`layers/mlp.py`). Fewer bytes per
kept layer means `fastqwen_checkpointing: auto` keeps more layers, and each layer kept is a
forward not recomputed.

How: while a kept layer runs forward, saved-tensor hooks see every tensor autograd saves. An
output marked `recomputable` (the norms' forward hooks, and `recomputable(...)` in the Gated
DeltaNet, attention and MLP forwards) is packed as its recipe, not its storage, when some consumer
saves it or a view of it; backward's unpack runs the recipe: the same function on the same
inputs, so the same bits.
A recipe is used only where every input it reads was itself saved earlier in that forward (by the
norm's own backward) and is unchanged: otherwise holding the inputs would cost what dropping the
output saves (transformers' RMSNorm under autocast saves an fp32 copy, not its input), and the
output is saved as before. Saved-tensor hooks already active (activation offloading) get every
tensor not dropped. Layers recomputed by checkpointing, and forwards without grad, are untouched.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

# why an output was held after all, as the report says it
INPUT_NOT_SAVED = "an input was not saved by its own op, so dropping would hold it instead"
_THREAD = threading.local()  # per thread, as autograd's saved-tensor hooks are (nn.DataParallel runs threads)


def _active() -> list[_LayerForward]:
    """The lean layer forwards running in this thread, innermost last (decoder layers do not nest)."""
    if not hasattr(_THREAD, "stack"):
        _THREAD.stack = []
    return _THREAD.stack


def recomputable(fn: Callable[..., torch.Tensor], *args, **kwargs) -> torch.Tensor:
    """`fn(*args, **kwargs)`, its output marked as recomputable from them (no-op outside a lean forward)."""
    out = fn(*args, **kwargs)
    active = _active()
    if active:
        active[-1].mark(out, fn, args, kwargs)
    return out


def _storage(t: torch.Tensor) -> int | None:
    """The address of `t`'s storage: what a view shares with its base. None for tensors without one."""
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):  # subclasses, nested and meta tensors
        return None
    return storage.data_ptr() if storage.nbytes() else None


class LeanActivationsError(RuntimeError):
    """Backward met a dropped output that cannot be recomputed exactly."""


@dataclass
class _Recipe:
    """How to recompute one dropped output, and the value once recomputed (shared by its views)."""

    fn: Callable[..., torch.Tensor]
    args: tuple
    kwargs: dict
    versions: list[tuple[torch.Tensor, int]]  # every tensor input, with its version at the forward
    shape: torch.Size
    dtype: torch.dtype
    autocast: tuple[str, bool, torch.dtype]
    value: torch.Tensor | None = None

    def recompute(self) -> torch.Tensor:
        if self.value is not None:
            return self.value
        if torch.is_grad_enabled() and torch._C._current_graph_task_id() != -1:
            raise LeanActivationsError(
                "backward with create_graph=True reached an activation that fastqwen_lean_activations dropped: "
                "its recomputed value would carry no graph. Set fastqwen_lean_activations: false for "
                "double backward.")
        for tensor, version in self.versions:
            if tensor._version != version:
                raise LeanActivationsError(
                    f"an input or weight of {getattr(self.fn, '__qualname__', self.fn)} (shape "
                    f"{tuple(tensor.shape)}) was "
                    "modified in place between the forward and the backward, so the output dropped by "
                    "fastqwen_lean_activations cannot be recomputed. Set fastqwen_lean_activations: false.")
        device_type, enabled, dtype = self.autocast
        with torch.no_grad(), torch.autocast(device_type, dtype=dtype, enabled=enabled):
            value = self.fn(*self.args, **self.kwargs)
        if value.shape != self.shape or value.dtype != self.dtype or not value.is_contiguous():
            raise LeanActivationsError(
                f"recomputing {getattr(self.fn, '__qualname__', self.fn)} gave {tuple(value.shape)} {value.dtype}, "
                f"not the forward's {tuple(self.shape)} {self.dtype} (contiguous). Set "
                "fastqwen_lean_activations: false and report this.")
        self.value = value
        return value


@dataclass
class _Marked:
    out: torch.Tensor  # held only while the layer's forward runs: its storage cannot be reused meanwhile
    version: int
    inputs: list[int]  # storages of the non-parameter tensor inputs
    recipe: _Recipe
    dropped: bool = False


@dataclass
class _Handle:
    """What autograd holds instead of a dropped tensor: a view of the recipe's value."""

    recipe: _Recipe
    size: torch.Size
    stride: tuple[int, ...]
    offset: int

    def value(self) -> torch.Tensor:
        return self.recipe.recompute().as_strided(self.size, self.stride, self.offset)


@dataclass
class _LayerForward:
    """One kept layer's forward: what was saved, what may be dropped, what was."""

    outer: tuple[Callable, Callable] | None
    saved: set[int] = field(default_factory=set)
    marked: dict[int, _Marked] = field(default_factory=dict)
    kept_because: dict[str, int] = field(default_factory=dict)

    def mark(self, out: torch.Tensor, fn: Callable, args: Sequence, kwargs: dict,
             state: Sequence[torch.Tensor] = ()) -> None:
        """`out` = fn(*args, **kwargs); `state`: tensors fn reads besides its arguments (a module's weights)."""
        key = _storage(out) if isinstance(out, torch.Tensor) else None
        if key is None or not out.is_contiguous() or out.storage_offset() \
                or out.untyped_storage().nbytes() != out.numel() * out.element_size():
            return  # only whole-storage outputs: a recompute gives exactly that layout back
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        device_type = out.device.type
        recipe = _Recipe(fn, tuple(args), dict(kwargs), [(t, t._version) for t in (*tensors, *state)], out.shape,
                         out.dtype,
                         (device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)))
        inputs = [_storage(t) for t in tensors if not isinstance(t, nn.Parameter)]
        self.marked[key] = _Marked(out, out._version, inputs, recipe)

    def pack(self, t: torch.Tensor):
        key = _storage(t)
        marked = self.marked.get(key) if key is not None else None
        if marked is not None and t.dtype == marked.out.dtype:
            why = self._why_kept(t, marked)
            if why is None:
                marked.dropped = True
                return _Handle(marked.recipe, t.size(), t.stride(), t.storage_offset())
            self.kept_because[why] = self.kept_because.get(why, 0) + 1
        if key is not None:
            self.saved.add(key)
        return self.outer[0](t) if self.outer is not None else t

    def _why_kept(self, t: torch.Tensor, marked: _Marked) -> str | None:
        if t._version != marked.version:
            return "modified in place after its forward"
        if any(key is None or key not in self.saved for key in marked.inputs):
            return INPUT_NOT_SAVED
        if any(tensor._version != version for tensor, version in marked.recipe.versions):
            return "an input modified in place after the forward"
        return None

    def finish(self) -> tuple[int, int]:
        """(outputs dropped, their bytes); releases the outputs the forward held."""
        dropped = [m for m in self.marked.values() if m.dropped]
        nbytes = sum(m.out.numel() * m.out.element_size() for m in dropped)
        for m in self.marked.values():
            m.out = None  # type: ignore[assignment]
        self.marked.clear()
        return len(dropped), nbytes

    def unpack(self, obj):
        if isinstance(obj, _Handle):
            return obj.value()
        return self.outer[1](obj) if self.outer is not None else obj


class LeanActivations:
    """Installs the hooks on a decoder's layers and their norms; `restore()` takes them off."""

    def __init__(self, layers: Sequence[nn.Module], norm_names: Sequence[str]):
        self.layers = list(layers)
        self.handles: list = []
        self.stats: dict[int, tuple[int, int, dict[str, int]]] = {}  # layer index -> its last lean forward
        self._thread = threading.local()  # `pushed`: per layer forward running, its state or None (not lean)
        top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
        if top is None:
            raise RuntimeError(f"torch {torch.__version__} does not expose the active saved-tensor hooks: "
                               "fastqwen_lean_activations cannot compose with them. Set it false.")
        self._top = top
        for index, layer in enumerate(self.layers):
            self.handles.append(layer.register_forward_pre_hook(
                lambda module, args, index=index: self._enter(index, module)))
            self.handles.append(layer.register_forward_hook(
                lambda module, args, output, index=index: self._leave(index), always_call=True))
            for name in norm_names:
                norm = getattr(layer, name, None)
                if isinstance(norm, nn.Module):
                    self.handles.append(norm.register_forward_hook(_mark_norm_output, with_kwargs=True))

    def _enter(self, index: int, layer: nn.Module) -> None:
        recomputed = getattr(layer, "gradient_checkpointing", False) and layer.training
        lean = torch.is_grad_enabled() and not recomputed and torch._C._autograd._saved_tensors_hooks_is_enabled()
        pushed = self._pushed()
        if not lean:
            if torch.is_grad_enabled():
                self.stats.pop(index, None)  # a training forward without lean: its last figures are stale
            pushed.append(None)
            return
        forward = _LayerForward(outer=self._top(False))
        torch._C._autograd._push_saved_tensors_default_hooks(forward.pack, forward.unpack)
        _active().append(forward)
        pushed.append(forward)

    def _pushed(self) -> list[_LayerForward | None]:
        if not hasattr(self._thread, "pushed"):
            self._thread.pushed = []
        return self._thread.pushed

    def _leave(self, index: int) -> None:
        pushed = self._pushed()
        forward = pushed.pop() if pushed else None
        if forward is None:
            return
        torch._C._autograd._pop_saved_tensors_default_hooks()
        _active().pop()
        count, nbytes = forward.finish()
        self.stats[index] = (count, nbytes, dict(forward.kept_because))

    def restore(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def to_dict(self) -> dict:
        kept = {}
        for _, _, why in self.stats.values():
            for reason, n in why.items():
                kept[reason] = kept.get(reason, 0) + n
        return {
            "layers_hooked": len(self.layers),
            "lean_layers_last_forward": len(self.stats),
            "outputs_dropped_per_forward": sum(c for c, _, _ in self.stats.values()),
            "mib_dropped_per_forward": round(sum(b for _, b, _ in self.stats.values()) / 2**20, 1),
            "saves_kept": kept,
        }


def _mark_norm_output(module: nn.Module, args: tuple, kwargs: dict, output) -> None:
    active = _active()
    if active and isinstance(output, torch.Tensor):
        active[-1].mark(output, module.forward, args, kwargs, [*module.parameters(), *module.buffers()])
