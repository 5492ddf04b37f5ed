"""Where a module instance's own forward lives, for patches that replace it per instance, and the
replacement itself: done and undone the same way by every such patch."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn


def forward_attr(module: nn.Module) -> str:
    """Where the module's real forward is: accelerate's dispatch hooks keep it in `_old_forward`."""
    return "_old_forward" if hasattr(module, "_hf_hook") and "_old_forward" in module.__dict__ else "forward"


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
