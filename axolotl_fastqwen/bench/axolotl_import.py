"""Import Axolotl's Qwen3.5 packing patch on a partial Axolotl install (benchmark path (d)).

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
        raise NotImplementedError(f"bitsandbytes.{name}: import-only stand-in (axolotl_fastqwen.bench)")

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


@contextlib.contextmanager
def callbacks_package_without_init() -> Iterator[str | None]:
    """Yields None when Axolotl's callbacks package imports, else the module it was missing."""
    try:
        importlib.import_module(CALLBACKS)
        yield None
        return
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.split(".")[0] == "axolotl":
            raise
        missing = exc.name
    spec = importlib.util.find_spec("axolotl.utils")
    package = types.ModuleType(CALLBACKS)
    package.__path__ = [p + "/callbacks" for p in spec.submodule_search_locations]
    package.__package__ = CALLBACKS
    sys.modules[CALLBACKS] = package
    try:
        yield missing
    finally:
        if sys.modules.get(CALLBACKS) is package:
            del sys.modules[CALLBACKS]


def import_axolotl_patch(module_name: str) -> tuple[object, list[str]]:
    """The patch module, and what was stood in to import it (empty on a full Axolotl install)."""
    with bitsandbytes_import_names() as bnb, callbacks_package_without_init() as missing:
        module = importlib.import_module(module_name)
    stood_in = ["bitsandbytes (import-only names)"] if bnb else []
    if missing:
        stood_in.append(f"{CALLBACKS} package __init__ (it needs {missing}, absent here)")
    return module, stood_in
