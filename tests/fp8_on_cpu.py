"""A test-only Axolotl plugin: `fastqwen_fp8` through a real `axolotl train` on the CPU.

On a machine without FP8 tensor cores the key is refused at config load (tests/test_axolotl_train.py
checks that message). Named first in a test YAML (with tests/ on PYTHONPATH), this module, imported
when Axolotl instantiates the plugins and so before any plugin's `register` reads the config, makes
the plugin see a Hopper GPU there and lets the toy model's 64-256-wide projections count as large
enough for FP8. Everything after that is the real path, on PyTorch's CPU FP8 GEMM: the hooks, the
patch after peft wraps the model, Axolotl's trainer and optimizer, the adapter saved at the end.
"""

from __future__ import annotations

from axolotl.integrations.base import BasePlugin

from axolotl_fastqwen.integration import settings
from axolotl_fastqwen.patching import fp8_weights

STAND_IN = ("CPU standing in for an sm_90 GPU (tests/fp8_on_cpu.py)", (9, 0))

settings.Environment.detect = classmethod(lambda cls: cls(cuda_devices=1, processes=1, flash_attn=False,
                                                          gpu=STAND_IN))
fp8_weights.MIN_FEATURES = 64


class Fp8OnCpu(BasePlugin):
    """Does nothing itself: importing the module is the point."""
