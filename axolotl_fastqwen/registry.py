"""The pluggy plugin manager: the built-in families and kernels plus installed extensions.

The built-in modules register through the same hooks an extension uses (hookspecs.py); an
extension is any module exposed under the entry-point group `axolotl_fastqwen.extensions`.
"""

from __future__ import annotations

import functools

import pluggy

from .families import qwen3_5, qwen3_5_moe, qwen3_next
from .hookspecs import ENTRY_POINT_GROUP, PROJECT, FastQwenSpec
from .ops import MODULES as OP_MODULES

BUILTIN_EXTENSIONS = (qwen3_5, qwen3_5_moe, qwen3_next, *OP_MODULES)


@functools.cache
def plugin_manager() -> pluggy.PluginManager:
    pm = pluggy.PluginManager(PROJECT)
    pm.add_hookspecs(FastQwenSpec)
    for module in BUILTIN_EXTENSIONS:
        pm.register(module, name=module.__name__)
    pm.load_setuptools_entrypoints(ENTRY_POINT_GROUP)
    return pm


def reset() -> None:
    """Forget the cached manager (tests that install an extension at run time)."""
    plugin_manager.cache_clear()


def families() -> list:
    return [family for batch in plugin_manager().hook.fastqwen_families() for family in batch]


def family(name: str):
    """The registered family called `name` (or owning that model type)."""
    for f in families():
        if name == f.name or name in f.model_types:
            return f
    raise KeyError(f"no family {name!r}; registered: {[f.name for f in families()]}")


def kernel_backends() -> list:
    return [backend for batch in plugin_manager().hook.fastqwen_kernel_backends() for backend in batch]
