"""Import Axolotl's modules on a partial Axolotl install (benchmark paths axolotl-packing, axolotl-best).

Axolotl 0.21's `monkeypatch.models.qwen3_5.modeling` imports its LoRA kernels, which import
bitsandbytes at module load; the packing patch itself never calls bitsandbytes for an unquantized
model. The offline GPU machine cannot carry the real wheel (43 MB of a 64 MiB transfer limit), so
only for the duration of that import, and only when bitsandbytes is absent, stand-in modules
provide the names Axolotl imports. They are removed from `sys.modules` afterwards, so nothing else
(peft's availability checks) ever sees them; any call through them raises.

The same import also passes through `axolotl.utils.callbacks`, whose package `__init__` imports
Trainer-callback dependencies (evaluate, datasets, wandb, trl, opentelemetry: tens of MB the GPU
machine does not have) while the patch needs one helper from its `models` submodule. When that
`__init__` cannot be imported, a bare package with Axolotl's real `__path__` stands in for it, so
every module the patch runs is Axolotl's own file, unchanged.

The axolotl-best path also imports Axolotl's Liger and kernels (ScatterMoE) integrations, whose
package `__init__`s import pydantic for their config classes (the GPU image has no pydantic);
they stand in the same way (`packages_without_init`), for as long as that path runs.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import sys
import types
from collections.abc import Iterator


def _refuse(name: str):
    def call(*args, **kwargs):
        raise NotImplementedError(f"bitsandbytes.{name}: import-only stand-in (fastqwen_bench)")

    return call


class _Refusing(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _refuse(f"{self.__name__}.{name}")


@contextlib.contextmanager
def bitsandbytes_import_names() -> Iterator[bool]:
    """Yields True when the stand-ins were installed (the record says so), False when not needed."""
    if importlib.util.find_spec("bitsandbytes") is not None:
        yield False
        return
    package, functional = _Refusing("bitsandbytes"), _Refusing("bitsandbytes.functional")
    functional.QuantState = type("QuantState", (), {"__init__": _refuse("functional.QuantState")})
    functional.lib = _Refusing("bitsandbytes.functional.lib")  # Axolotl reads C symbols off it at import
    package.functional = functional
    sys.modules["bitsandbytes"], sys.modules["bitsandbytes.functional"] = package, functional
    try:
        yield True
    finally:
        sys.modules.pop("bitsandbytes", None)
        sys.modules.pop("bitsandbytes.functional", None)


CALLBACKS = "axolotl.utils.callbacks"
# Package `__init__`s that import only what a package's plugin / argument classes need (pydantic,
# Trainer-callback dependencies), never what the benchmark calls: their submodules are Axolotl's
# own files and load under a bare stand-in package when the `__init__` cannot import.
LIGER = "axolotl.integrations.liger"  # __init__: LigerArgs (pydantic), LigerPlugin (trl shim)
KERNELS = "axolotl.integrations.kernels"  # __init__: KernelsArgs (pydantic), KernelsPlugin
PACKAGES_WITHOUT_INIT = (CALLBACKS, LIGER, KERNELS)


def _bare_package(name: str) -> str | None:
    """Import package `name`; if its `__init__` needs a third-party module that is absent, put a
    bare package with Axolotl's real `__path__` in `sys.modules` instead. Returns the missing
    module's name when it stood in, else None (real package imported)."""
    try:
        importlib.import_module(name)
        return None
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.split(".")[0] == "axolotl":
            raise
        missing = exc.name
    parent, _, leaf = name.rpartition(".")
    spec = importlib.util.find_spec(parent)
    package = types.ModuleType(name)
    package.__path__ = [f"{p}/{leaf}" for p in spec.submodule_search_locations]
    package.__package__ = name
    sys.modules[name] = package
    return missing


@contextlib.contextmanager
def packages_without_init(names=PACKAGES_WITHOUT_INIT) -> Iterator[dict[str, str]]:
    """Yields {package: missing module} for each package that stood in; removes them on exit."""
    stood_in: dict[str, str] = {}
    bare: dict[str, types.ModuleType] = {}
    try:
        for name in names:
            missing = _bare_package(name)
            if missing:
                stood_in[name] = missing
                bare[name] = sys.modules[name]
        yield stood_in
    finally:
        for name, package in bare.items():
            if sys.modules.get(name) is package:
                del sys.modules[name]


@contextlib.contextmanager
def callbacks_package_without_init() -> Iterator[str | None]:
    """Yields None when Axolotl's callbacks package imports, else the module it was missing."""
    with packages_without_init((CALLBACKS,)) as stood_in:
        yield stood_in.get(CALLBACKS)


def describe_stand_ins(bnb: bool, packages: dict[str, str]) -> list[str]:
    out = ["bitsandbytes (import-only names)"] if bnb else []
    out += [f"{name} package __init__ (it needs {missing}, absent here)" for name, missing in packages.items()]
    return out


def import_axolotl_patch(module_name: str) -> tuple[object, list[str]]:
    """The patch module, and what was stood in to import it (empty on a full Axolotl install)."""
    with bitsandbytes_import_names() as bnb, callbacks_package_without_init() as missing:
        module = importlib.import_module(module_name)
    return module, describe_stand_ins(bnb, {CALLBACKS: missing} if missing else {})


@contextlib.contextmanager
def axolotl_modules(names) -> Iterator[tuple[dict[str, object], list[str], dict[str, str]]]:
    """Import several Axolotl modules on a partial install, for the length of the `with` block.

    bitsandbytes' import names stand in only while importing (as above); the bare packages stay
    in `sys.modules` until the block ends, because Axolotl's functions import siblings lazily at
    call time (`from .x import y` inside a function needs its parent package). Yields
    ({name: module or the exception it raised}, what was stood in, {name: import error}).
    """
    with packages_without_init() as packages:
        modules, errors = {}, {}
        with bitsandbytes_import_names() as bnb:
            for name in names:
                try:
                    modules[name] = importlib.import_module(name)
                except Exception as exc:  # recorded by the caller as that component's refusal
                    errors[name] = f"{type(exc).__name__}: {str(exc)[:300]}"
        yield modules, describe_stand_ins(bnb, packages), errors
