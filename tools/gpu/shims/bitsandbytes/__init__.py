"""Import-only stand-in for bitsandbytes on the offline GPU machine (benchmark path (d) only).

Axolotl 0.21's Qwen3.5 packing module imports its LoRA kernels, which import bitsandbytes at
module load. The real wheel (43 MB) does not fit in the 64 MiB a GPU call may carry, and the
packing patch never calls it for an unquantized model. Anything that does call it fails loudly.
"""

from . import functional  # noqa: F401

__version__ = "0.0-import-only-stand-in"


def __getattr__(name):
    raise NotImplementedError(f"bitsandbytes.{name}: import-only stand-in (tools/gpu/shims), not the real library")
