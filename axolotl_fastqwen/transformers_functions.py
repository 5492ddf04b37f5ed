"""Control over the kernels that stock transformers picks for the Qwen hybrid layers.

Transformers resolves `torch_chunk_gated_delta_rule`, `causal_conv1d_fn`, ... once, at import:
to fla / causal-conv1d when importable, else to its PyTorch fallback. Before 5.25 the package then
runs on a CPU too, and crashes; 5.25+ sends inputs on a device the package does not support to
the PyTorch fallback itself. With the `kernels` package installed, each is further wrapped in a
tiny `nn.Module`. The baselines of our tests and benchmarks need the *stock* layers on a *chosen*
kernel, so this module finds the PyTorch fallback behind those wrappers and swaps it in,
reversibly. The plugin's own layers never go through these globals; the one stock path the
patched model keeps (generation with a recurrent cache) runs on the fallbacks when on a CPU.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
from collections.abc import Callable, Iterator
from types import ModuleType

import torch

# Module-level kernel functions of the Qwen hybrid modeling files (transformers 5.17 - 5.25).
KERNEL_GLOBALS = (
    "torch_chunk_gated_delta_rule",
    "torch_recurrent_gated_delta_rule",
    "causal_conv1d_fn",
    "causal_conv1d_update",
)

def modeling_module(family_or_module: str | ModuleType) -> ModuleType:
    """The transformers modeling module of a registered family (by its name or one of its model
    types), or of a module path."""
    if isinstance(family_or_module, ModuleType):
        return family_or_module
    if family_or_module.startswith("transformers."):
        return importlib.import_module(family_or_module)
    from . import registry

    try:
        return importlib.import_module(registry.family(family_or_module).modeling_module)
    except KeyError as exc:
        raise ValueError(f"unknown family/model_type {family_or_module!r}: {exc.args[0]}") from None


def _closure_function(method: Callable) -> Callable | None:
    for cell in getattr(method, "__closure__", None) or ():
        if callable(cell.cell_contents):
            return cell.cell_contents
    return None


def torch_fallback(fn: Callable, name: str | None = None) -> Callable:
    """The pure-PyTorch function behind a transformers kernel wrapper.

    transformers' wrapper keeps it as `__wrapped__`; the `kernels` package wraps that again in a
    `Func` module whose `forward` closes over it. With `name`, the result must be the modeling
    file's own `def name` (raises otherwise), so a changed wrapper layout cannot go unnoticed.
    """
    if type(fn).__name__ == "Func":
        fn = _closure_function(type(fn).forward) or fn
    fn = inspect.unwrap(fn)
    if name is not None:
        code = getattr(fn, "__code__", None)
        if code is None or code.co_name != name:
            raise RuntimeError(f"could not find the PyTorch fallback of {name} (got {fn!r})")
    return fn


def _closure_cells(fn: Callable) -> dict[str, object]:
    """A function's closure by variable name (what a decorator closed over)."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return {}
    cells = {}
    for name, cell in zip(code.co_freevars, getattr(fn, "__closure__", None) or ()):
        try:
            cells[name] = cell.cell_contents
        except ValueError:  # an empty cell
            pass
    return cells


def resolved_kernel(family: str | ModuleType, name: str, device_type: str | None = None) -> str:
    """Which implementation a stock global resolves to: 'torch' or the providing package.

    With `device_type`, the one that runs for inputs on that device: transformers 5.25+ keeps the
    package's supported devices beside it (`supported_devices`) and sends inputs on any other
    device (a CPU) to its PyTorch function itself; before 5.25 the package ran, and crashed."""
    fn = getattr(modeling_module(family), name)
    if type(fn).__name__ == "Func":
        fn = _closure_function(type(fn).forward) or fn
    cells = _closure_cells(fn)
    # transformers' fallback wrapper closes over the implementation it picked at import
    for value in cells.values():
        package = (getattr(value, "__module__", "") or "").split(".")[0]
        if callable(value) and package in ("fla", "causal_conv1d"):
            supported = cells.get("supported_devices")
            if device_type is not None and supported is not None and device_type not in supported:
                return "torch"
            return package
    return "torch"


def _refusing_packed_arguments(name: str, function: Callable) -> Callable:
    """The fallback, refusing `cu_seqlens` / `seq_idx` it cannot honour instead of leaking state
    silently (transformers 5.17's fallback drops them; 5.20+ raises, as this does)."""

    @functools.wraps(function)
    def call(*args, **kwargs):
        for key in ("cu_seqlens", "seq_idx"):
            if kwargs.get(key) is not None:
                raise ValueError(f"{name}: the PyTorch fallback cannot honour `{key}` (packed sequences)")
        return function(*args, **kwargs)

    return call


def stock_kernels_on_cpu(module_name: str | ModuleType, device) -> contextlib.AbstractContextManager:
    """`stock_torch_kernels(module)` when `device` is a CPU and the module resolved a CUDA kernel
    package (fla, causal-conv1d), else nothing to do."""
    if getattr(device, "type", device) != "cpu" or torch.compiler.is_compiling():
        return contextlib.nullcontext()  # (dynamo cannot trace a swap of module globals)
    module = modeling_module(module_name)
    if all(resolved_kernel(module, name, "cpu") == "torch" for name in KERNEL_GLOBALS if hasattr(module, name)):
        return contextlib.nullcontext()
    return stock_torch_kernels(module)


@contextlib.contextmanager
def stock_torch_kernels(*families: str | ModuleType) -> Iterator[ModuleType | None]:
    """Make the stock layers of `families` (default: all) use transformers' PyTorch fallbacks.

    Yields the modeling module when one family is given. Restores the globals on exit (nesting is
    fine). The swap is process-wide (module globals): not for concurrent threads.
    """
    if not families:
        from . import registry

        families = tuple(f.modeling_module for f in registry.families())
    modules = list(dict.fromkeys(modeling_module(f) for f in families))
    saved = []
    try:
        for module in modules:
            for name in KERNEL_GLOBALS:
                if hasattr(module, name):
                    current = getattr(module, name)
                    saved.append((module, name, current))
                    setattr(module, name, _refusing_packed_arguments(name, torch_fallback(current, name)))
        yield modules[0] if len(modules) == 1 else None
    finally:
        for module, name, value in reversed(saved):
            setattr(module, name, value)
