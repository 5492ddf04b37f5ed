"""The SwiGLU of the dense MLP (and of the MoE shared expert): `silu(gate) * up`, holding only gate and up.

Stock transformers runs it as two kernels (SiLU, then the multiply), each writing a `[tokens,
intermediate]` tensor, and autograd holds three of them for backward: gate (SiLU's input), silu(gate)
and up (the multiply's). Both implementations here hold gate and up alone and recompute silu(gate) in
backward: Liger's kernel (`liger_glu_activation`'s, one kernel each way) on a GPU, and an autograd
function of stock's own ops elsewhere (the same bits as stock, forward and backward). With the
product marked recomputable from them (`layers/mlp.py`), a lean kept layer holds two intermediates
per token where stock holds four (memory/lean_activations.py): 6.8 hidden sizes fewer per token in a
Qwen3.5-27B layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..hookspecs import hookimpl
from . import availability
from .backend import CheckShapes, KernelBackend, OpSpec, always, generator, on_cuda_with, randn


def liger_swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Liger's SiLU-and-multiply: silu in fp32, cast, times up (stock's roundings); its backward
    recomputes silu and writes the two gradients over the saved gate and up, which nothing reads after."""
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction

    return LigerSiLUMulFunction.apply(gate, up)


class _SwiGLU(torch.autograd.Function):
    """`F.silu(gate) * up` saving gate and up only; backward runs autograd's own formulas on them, op
    for op (mul's two products, then `silu_backward`), so every bit matches stock."""

    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        d_gate = d_up = None
        if ctx.needs_input_grad[0]:
            d_gate = torch.ops.aten.silu_backward(grad * up, gate)
        if ctx.needs_input_grad[1]:
            d_up = grad * F.silu(gate)
        return d_gate, d_up


def reference_swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Stock's math (`act_fn(gate) * up`), holding gate and up alone."""
    return _SwiGLU.apply(gate, up)


def check_inputs(shapes: CheckShapes, device, tokens: int):
    """gate, up [1, T, intermediate] at the projections' output scale."""
    gen = generator(device)
    return [randn(gen, device, 1, tokens, shapes.intermediate), randn(gen, device, 1, tokens, shapes.intermediate)], {}


def bind(fn, boundaries, extra):
    return fn


SPEC = OpSpec("swiglu", reference="torch", check_inputs=check_inputs, bind=bind)
BACKENDS = (
    KernelBackend("swiglu", "liger", liger_swiglu, 100,
                  on_cuda_with(availability.has_liger, availability.LIGER_HINT), "liger_kernel"),
    # stock's own math and roundings: without Liger the MLP computes exactly what it would without the plugin
    KernelBackend("swiglu", "torch", reference_swiglu, 0, always),
)


@hookimpl
def fastqwen_kernel_backends():
    return list(BACKENDS)
