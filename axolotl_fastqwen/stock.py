"""Control over the kernels that stock transformers picks for the Qwen hybrid layers.

Transformers resolves `torch_chunk_gated_delta_rule`, `causal_conv1d_fn`, ... once, at import:
to fla / causal-conv1d when importable (on a CPU machine too, where they crash), else to its
PyTorch fallback. With the `kernels` package installed, each is further wrapped in a tiny
`nn.Module`. The baselines of our tests and benchmarks need the *stock* layers on a *chosen*
kernel, so this module finds the PyTorch fallback behind those wrappers and swaps it in,
reversibly. The plugin's own layers never go through these globals.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator
from types import ModuleType

# Module-level kernel functions of the Qwen hybrid modeling files (transformers 5.17 - 5.25).
KERNEL_GLOBALS = (
    "torch_chunk_gated_delta_rule",
    "torch_recurrent_gated_delta_rule",
    "causal_conv1d_fn",
    "causal_conv1d_update",
)

MODELING_MODULES = {
    "qwen3_5": "transformers.models.qwen3_5.modeling_qwen3_5",
    "qwen3_5_moe": "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe",
    "qwen3_next": "transformers.models.qwen3_next.modeling_qwen3_next",
}


def torch_fallback(fn: Callable) -> Callable:
    """The pure-PyTorch function behind a transformers kernel wrapper (or `fn` itself)."""
    for _ in range(8):
        if type(fn).__name__ == "Func":  # the `kernels` package's function-as-module wrapper
            inner = _closure_function(type(fn).forward)
        else:  # transformers' fallback wrapper is a functools.wraps of the torch function
            inner = getattr(fn, "__wrapped__", None)
        if inner is None:
            break
        fn = inner
    return fn


def _closure_function(method: Callable) -> Callable | None:
    for cell in getattr(method, "__closure__", None) or ():
        if callable(cell.cell_contents):
            return cell.cell_contents
    return None


def modeling_module(family_or_module: str | ModuleType) -> ModuleType:
    if isinstance(family_or_module, ModuleType):
        return family_or_module
    return importlib.import_module(MODELING_MODULES.get(family_or_module, family_or_module))


def resolved_kernel(family: str, name: str) -> str:
    """Which implementation a stock global resolves to: 'torch' or the providing package."""
    fn = getattr(modeling_module(family), name)
    inner = fn
    if type(fn).__name__ == "Func":
        inner = _closure_function(type(fn).forward) or fn
    chosen = inner
    # transformers' fallback wrapper closes over the implementation it picked at import
    for cell in getattr(inner, "__closure__", None) or ():
        value = cell.cell_contents
        if callable(value) and getattr(value, "__module__", "").split(".")[0] in ("fla", "causal_conv1d"):
            chosen = value
    package = getattr(chosen, "__module__", "") or ""
    return package.split(".")[0] if package.split(".")[0] in ("fla", "causal_conv1d") else "torch"


@contextlib.contextmanager
def stock_torch_kernels(*families: str) -> Iterator[None]:
    """Make the stock layers of `families` (default: all) use transformers' PyTorch fallbacks."""
    saved = []
    try:
        for family in families or tuple(MODELING_MODULES):
            module = modeling_module(family)
            for name in KERNEL_GLOBALS:
                if hasattr(module, name):
                    saved.append((module, name, getattr(module, name)))
                    setattr(module, name, torch_fallback(getattr(module, name)))
        yield
    finally:
        for module, name, value in reversed(saved):
            setattr(module, name, value)
