"""pluggy extension points: how model families and kernel backends get registered.

The built-in families and kernels register through these same hooks. A third-party package adds
its own by exposing a module with `@hookimpl` functions under the setuptools entry-point group
`axolotl_fastqwen.extensions`, e.g. in its pyproject.toml:

    [project.entry-points."axolotl_fastqwen.extensions"]
    my_family = "my_package.fastqwen_family"
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import pluggy

PROJECT = "axolotl_fastqwen"
ENTRY_POINT_GROUP = "axolotl_fastqwen.extensions"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

if TYPE_CHECKING:
    from .families.base import Family
    from .kernels import KernelBackend


class FastQwenSpec:
    @hookspec
    def fastqwen_families(self) -> Sequence[Family]:
        """Model families this extension can patch: detection by class, the layer-specific input
        projection, and the transformers module whose stock layers are the reference."""

    @hookspec
    def fastqwen_kernel_backends(self) -> Sequence[KernelBackend]:
        """Kernel implementations of the ops in `axolotl_fastqwen.kernels.OPS`, each with an
        availability check; the highest-priority available one that passes the self-check is used."""
