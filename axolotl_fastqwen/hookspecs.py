"""pluggy extension points: how model families and kernel backends get registered.

The built-in families and kernels register through these same hooks (registry.py). A third-party
package adds its own by exposing a module with `@hookimpl` functions under the setuptools
entry-point group `axolotl_fastqwen.extensions`, e.g. in its pyproject.toml:

    [project.entry-points."axolotl_fastqwen.extensions"]
    my_family = "my_package.fastqwen_family"

tests/test_extension_seam.py installs such a package and trains a model of its family with Axolotl.
"""

from __future__ import annotations

from collections.abc import Sequence

import pluggy

PROJECT = "axolotl_fastqwen"
ENTRY_POINT_GROUP = "axolotl_fastqwen.extensions"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


class FastQwenSpec:
    @hookspec
    def fastqwen_families(self) -> Sequence:
        """`families.base.Family` descriptions this extension can patch: every fact about the family
        (its transformers classes, its GDN input projection, its LoRA targets, ...)."""

    @hookspec
    def fastqwen_kernel_backends(self) -> Sequence:
        """`ops.backend.KernelBackend`s for the ops in `ops.OPS`, each with its availability check
        (and optional per-call limits); the highest-priority available one that passes the
        self-check runs."""
