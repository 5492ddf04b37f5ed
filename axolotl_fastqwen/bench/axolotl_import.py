"""Import Axolotl's Qwen3.5 packing patch on a machine without bitsandbytes (benchmark path (d)).

Axolotl 0.21's `monkeypatch.models.qwen3_5.modeling` imports its LoRA kernels, which import
bitsandbytes at module load; the packing patch itself never calls bitsandbytes for an unquantized
model. The offline GPU machine cannot carry the real wheel (43 MB of a 64 MiB transfer limit), so
only for the duration of that import, and only when bitsandbytes is absent, stand-in modules
provide the names Axolotl imports. They are removed from `sys.modules` afterwards, so nothing else
(peft's availability checks) ever sees them; any call through them raises.
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


def import_axolotl_patch(module_name: str):
    with bitsandbytes_import_names() as stood_in:
        module = importlib.import_module(module_name)
    return module, stood_in
