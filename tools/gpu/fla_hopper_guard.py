"""An Axolotl plugin for the `axolotl` comparison run: lifts fla's Hopper guard (fla#640).

flash-linear-attention (0.5.2 and 0.6.0) raises in its gated chunk backward
(``chunk_bwd_dqkwg``: "Triton >= 3.4.0 and < 3.7.1 on Hopper GPUs produces incorrect results")
when it sees a Hopper GPU with Triton < 3.7.1. The H200 image has torch 2.11 + Triton 3.6.0, older
than the torch >= 2.13 (Triton >= 3.7) that Axolotl 0.21 asks for, so Axolotl's Qwen3.5 packing
patch, which calls fla's ``chunk_gated_delta_rule``, would stop at its first backward there.
Our plugin lifts the same guard itself, after its self-check has run the kernel at the model's
head dims against the fp32 reference (K = V = 128: rel. error 6e-3, benchmarks/h200); this plugin
lifts it for the run without ours, so both runs use the same fla kernels. fla reads the module
global at call time, which is the only switch it offers. `register` runs at config load, before
any model code. Logged as ``fla_hopper_guard: lifted ...``; nothing else changes.
"""

from __future__ import annotations

import logging

from axolotl.integrations.base import BasePlugin

LOG = logging.getLogger("fla_hopper_guard")


def lift() -> str:
    try:
        import fla.ops.common.chunk_o as chunk_o
    except Exception as exc:  # noqa: BLE001
        return f"fla not importable ({type(exc).__name__})"
    active = bool(chunk_o.IS_NVIDIA_HOPPER and chunk_o.TRITON_ABOVE_3_4_0 and not chunk_o.TRITON_ABOVE_3_7_1)
    if not active:
        return "not active here"
    chunk_o.TRITON_ABOVE_3_7_1 = True
    return "lifted (Hopper GPU, Triton >= 3.4 and < 3.7.1)"


class LiftFlaHopperGuardPlugin(BasePlugin):
    def register(self, cfg):
        message = f"fla_hopper_guard: {lift()}"
        LOG.warning(message)
        print(message, flush=True)  # in train.log whatever the logging setup
