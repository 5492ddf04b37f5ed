"""axolotl_fastqwen: fast, boundary-correct fine-tuning of Qwen hybrid (Gated DeltaNet) models.

In Axolotl: add `plugins: [axolotl_fastqwen.FastQwenPlugin]` (or just `axolotl_fastqwen`).
Elsewhere: `patch_model(model)` installs the fused layers, `unpatch_model(model)` removes them,
and `axolotl_fastqwen.packing` gives the static-shape 1D packer.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"
__all__ = ["FastQwenPlugin", "PatchReport", "patch_model", "unpatch_model", "__version__"]

if TYPE_CHECKING:
    from .patching.patch import PatchReport, patch_model, unpatch_model
    from .integration.plugin import FastQwenPlugin

# Imported when first asked for: torch and transformers for the patcher, Axolotl for the plugin;
# `python -m axolotl_fastqwen report` needs neither.
_LAZY = {"PatchReport": "patching", "patch_model": "patching", "unpatch_model": "patching",
         "FastQwenPlugin": "integration.plugin"}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
