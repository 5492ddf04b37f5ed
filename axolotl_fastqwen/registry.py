"""The pluggy plugin manager: built-in families and kernels plus installed extensions."""

from __future__ import annotations

import functools
import importlib

import pluggy

from .hookspecs import ENTRY_POINT_GROUP, PROJECT, FastQwenSpec

BUILTIN_EXTENSIONS = (
    "axolotl_fastqwen.families.qwen3_5",
    "axolotl_fastqwen.families.qwen3_5_moe",
    "axolotl_fastqwen.families.qwen3_next",
    "axolotl_fastqwen.kernels",
)


@functools.cache
def plugin_manager() -> pluggy.PluginManager:
    pm = pluggy.PluginManager(PROJECT)
    pm.add_hookspecs(FastQwenSpec)
    for name in BUILTIN_EXTENSIONS:
        pm.register(importlib.import_module(name), name=name)
    pm.load_setuptools_entrypoints(ENTRY_POINT_GROUP)
    return pm


def reset() -> None:
    """Forget the cached manager (tests that install an extension at run time)."""
    plugin_manager.cache_clear()


def families() -> list:
    return [family for batch in plugin_manager().hook.fastqwen_families() for family in batch]


def kernel_backends() -> list:
    return [backend for batch in plugin_manager().hook.fastqwen_kernel_backends() for backend in batch]
