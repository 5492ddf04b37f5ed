"""`BlockGraph`'s two CUDA graphs stood in by eager calls, for CPU runs of `patching/moe_cuda_graphs.py`.

The stand-in keeps the graphs' contract: the forward "replay" reads only the static input and leaves its
output (and its activations) in the graph object; the backward "replay" reads only the static output
gradient and writes the static gradients, which `_Replay` hands to autograd. It runs the block's own ops in
the same order, so a run with it must give the eager run's losses and gradients bit for bit; what it checks
is everything around the capture (which calls replay, the gradients autograd receives, the guards).
"""

from __future__ import annotations

import torch

from axolotl_fastqwen.patching import moe_cuda_graphs
from axolotl_fastqwen.patching.moe_cuda_graphs import BlockGraph


class EagerGraph(BlockGraph):
    """The two graphs of `BlockGraph` as eager calls under its contract (static tensors in and out)."""

    def _capture(self, original, device, owner) -> None:
        self.original, self.autocast = original, moe_cuda_graphs._autocast_state(device.type)
        self.static_grad_out = torch.zeros_like(original(self.static_x.detach()))
        self.static_out = self.static_grad_out.clone()
        self.static_grad_x = torch.zeros_like(self.static_x)
        self.static_grads = [torch.zeros_like(p) for p in self.params]
        self._out = None

    def replay_forward(self) -> None:
        enabled, dtype = self.autocast
        with torch.enable_grad(), torch.autocast("cpu", dtype=dtype, enabled=enabled, cache_enabled=False):
            self._out = self.original(self.static_x)
        self.static_out.copy_(self._out)

    def replay_backward(self) -> None:
        grads = torch.autograd.grad(self._out, (self.static_x, *self.params), self.static_grad_out, allow_unused=True)
        self.static_grad_x.copy_(grads[0])
        for static, g in zip(self.static_grads, grads[1:]):
            static.copy_(g)


def on_cpu(graphs: moe_cuda_graphs.MoeCudaGraphs) -> moe_cuda_graphs.MoeCudaGraphs:
    """Let `graphs` capture on the CPU, with the stand-in."""
    graphs.devices, graphs.graph_class = ("cpu",), EagerGraph
    return graphs


def install_on_cpu(keep_layers: bool = False) -> classmethod:
    """`MoeCudaGraphs.install` (as it is now) whose graphs capture on the CPU; with `keep_layers`, every decoder
    layer keeps its activations, as `fastqwen_checkpointing: auto` keeps them on a GPU where they fit."""
    install = moe_cuda_graphs.MoeCudaGraphs.install.__func__

    def installed(cls, layers, block_classes):
        for layer in layers if keep_layers else ():
            layer.gradient_checkpointing = False
        return on_cpu(install(cls, layers, block_classes))

    return classmethod(installed)
