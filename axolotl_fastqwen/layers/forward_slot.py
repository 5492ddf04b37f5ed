"""Where a module instance's real forward lives: the one fact every per-instance patch and every check
of "has someone replaced this forward?" needs. accelerate's dispatch hooks (`device_map`, offload)
move the real forward to `_old_forward` and put their own wrapper in `forward`."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn


def forward_attr(module: nn.Module) -> str:
    """`_old_forward` beneath accelerate's hook, else `forward`."""
    return "_old_forward" if hasattr(module, "_hf_hook") and "_old_forward" in module.__dict__ else "forward"


def bound_forward(module: nn.Module) -> Callable | None:
    """The forward someone bound to this instance (beneath accelerate's hook), or None where the class's
    own forward runs: accelerate's `_old_forward` is the class's forward bound, not a replacement."""
    forward = module.__dict__.get(forward_attr(module))
    if forward is None or getattr(forward, "__func__", None) is type(module).forward:
        return None
    return forward
