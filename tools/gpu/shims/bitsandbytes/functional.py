"""Names Axolotl imports from `bitsandbytes.functional`; none works (see the package docstring)."""


class QuantState:
    def __init__(self, *args, **kwargs):
        raise NotImplementedError("bitsandbytes.functional.QuantState: import-only stand-in")


def get_ptr(*args, **kwargs):
    raise NotImplementedError("bitsandbytes.functional.get_ptr: import-only stand-in")


class _Lib:
    def __getattr__(self, name):
        return _missing(name)


def _missing(name):
    def call(*args, **kwargs):
        raise NotImplementedError(f"bitsandbytes.functional.lib.{name}: import-only stand-in")

    return call


lib = _Lib()


def dequantize_4bit(*args, **kwargs):
    raise NotImplementedError("bitsandbytes.functional.dequantize_4bit: import-only stand-in")
