"""A test-only Axolotl plugin: `fastqwen_checkpoint_offload` moving tensors in a real `axolotl train` on the CPU.

The offload takes CUDA tensors of at least 1 MiB; on a CPU every tensor is already in host memory, so
the plugin would move nothing. Named in a test YAML (with tests/ on PYTHONPATH), this module makes the
offload take the toy's CPU tensors too, whatever their size: every checkpointed layer's input is then
copied into a host buffer and restored from it in backward, through Axolotl's trainer, as on a GPU
less the streams.
"""

from __future__ import annotations

from axolotl.integrations.base import BasePlugin

from axolotl_fastqwen.memory import checkpoint_offload

_sync_layers = checkpoint_offload.CheckpointOffload.sync_layers


def _sync_taking_cpu_tensors(self):
    self.devices, self.min_bytes = ("cpu",), 1
    _sync_layers(self)


checkpoint_offload.CheckpointOffload.sync_layers = _sync_taking_cpu_tensors


class OffloadOnCpu(BasePlugin):
    """Does nothing itself: importing the module is the point."""
