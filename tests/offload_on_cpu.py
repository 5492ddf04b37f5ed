"""A test-only Axolotl plugin: `fastqwen_checkpoint_offload` moving tensors in a real `axolotl train` on the CPU.

The offload takes CUDA tensors of at least 1 MiB; on a CPU every tensor is already in host memory, so
the plugin would move nothing. Named in a test YAML (with tests/ on PYTHONPATH), this module makes the
offload take the toy's CPU tensors too, whatever their size: every checkpointed layer's input is then
copied into a host buffer and restored from it in backward, through Axolotl's trainer, as on a GPU
less the streams. With `FASTQWEN_TEST_DEVICE_BYTES` set, `fastqwen_checkpoint_offload: auto` decides
as if the CPU were a device of that many bytes with nothing allocated (unset: a CPU has no device
memory to spare, and auto stays off, as on a real CPU run).
"""

from __future__ import annotations

import os

from axolotl.integrations.base import BasePlugin

from axolotl_fastqwen.memory import checkpoint_offload

_sync_layers = checkpoint_offload.CheckpointOffload.sync_layers


def _sync_taking_cpu_tensors(self):
    self.devices, self.min_bytes = ("cpu",), 1
    _sync_layers(self)


_decide = checkpoint_offload.CheckpointOffload.decide


def _decide_on_a_device_of_the_size_given(self, layer_input_bytes, device):
    self.devices, self.min_bytes = ("cpu",), 1
    size = os.environ.get("FASTQWEN_TEST_DEVICE_BYTES")
    if size is not None:
        self.device_memory = lambda device: (0, int(size))
    return _decide(self, layer_input_bytes, device)


checkpoint_offload.CheckpointOffload.sync_layers = _sync_taking_cpu_tensors
checkpoint_offload.CheckpointOffload.decide = _decide_on_a_device_of_the_size_given


class OffloadOnCpu(BasePlugin):
    """Does nothing itself: importing the module is the point."""
