"""Where a module instance's own forward lives, for patches that replace it per instance."""

from __future__ import annotations

from torch import nn


def forward_attr(module: nn.Module) -> str:
    """Where the module's real forward is: accelerate's dispatch hooks keep it in `_old_forward`."""
    return "_old_forward" if hasattr(module, "_hf_hook") and "_old_forward" in module.__dict__ else "forward"
