"""axolotl_fastqwen: fast, boundary-correct fine-tuning of Qwen hybrid (Gated DeltaNet) models.

In Axolotl: add `plugins: [axolotl_fastqwen.FastQwenPlugin]` (or just `axolotl_fastqwen`).
Elsewhere: `patch_model(model)` installs the fused layers, `unpatch_model(model)` removes them,
and `axolotl_fastqwen.packing` gives the static-shape 1D packer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .patching import PatchReport, patch_model, unpatch_model

__version__ = "0.1.0"
__all__ = ["FastQwenPlugin", "PatchReport", "patch_model", "unpatch_model", "__version__"]

if TYPE_CHECKING:
    from .plugin import FastQwenPlugin


def __getattr__(name: str):
    # Axolotl (and its heavy imports) only when the plugin class itself is asked for.
    if name == "FastQwenPlugin":
        from .plugin import FastQwenPlugin

        return FastQwenPlugin
    raise AttributeError(name)
