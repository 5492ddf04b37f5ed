"""A module instance's own forward replaced and given back, the same way by every patch that does it
(beneath accelerate's hook: `layers/forward_slot.py`)."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from ..layers.forward_slot import forward_attr


def replace_forward(module: nn.Module, key: str, make: Callable[[Callable], Callable]) -> None:
    """Set the instance's forward (beneath accelerate's hook) to `make(original)`; what `restore_forward`
    needs to undo it is kept in the module's `__dict__` under `key`."""
    attr = forward_attr(module)
    original = getattr(module, attr)
    module.__dict__[key] = (attr, attr in module.__dict__, original)
    setattr(module, attr, make(original))


def restore_forward(module: nn.Module, key: str) -> None:
    """Undo `replace_forward(module, key, ...)`: the instance forward it replaced, or none again."""
    attr, had_instance, original = module.__dict__.pop(key)
    if had_instance:
        setattr(module, attr, original)
    else:
        del module.__dict__[attr]
