"""The decoder's zero-centred RMSNorm, `rmsnorm(x) * (1 + weight)` in fp32, cast back to x's dtype.

Stock transformers runs it as ~7 fp32 elementwise kernels forward and more backward, and autograd
keeps an fp32 copy of the input and the fp32 normalised tensor: four bf16-sizes per token per
norm, two norms in every layer (plus q/k norms in attention). Liger's kernel (the one
`liger_rms_norm` installs for Qwen3.5, offset 1, Gemma casting) is one kernel each way and saves
only its input, which is also what lets lean activations drop the norm's output.
"""

from __future__ import annotations

import torch

from ..hookspecs import hookimpl
from . import availability
from .backend import CheckShapes, KernelBackend, OpSpec, always, generator, on_cuda_with, randn


def liger_rms_norm(x, weight, *, eps):
    """Liger's RMSNorm as `LigerRMSNormForQwen3Next` configures it (offset 1.0, gemma casting, not in place)."""
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction

    return LigerRMSNormFunction.apply(x, weight, eps, 1.0, "gemma", False, None)


def reference_rms_norm(x, weight, *, eps):
    """The stock Qwen computation, op for op (so the CPU path is stock bit for bit)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + weight.float())).type_as(x)


def check_inputs(shapes: CheckShapes, device, tokens: int):
    """x [1, T, hidden] and a small zero-centred weight (the trained norm's range)."""
    gen = generator(device)
    return [randn(gen, device, 1, tokens, shapes.hidden), randn(gen, device, shapes.hidden, scale=0.1)], {"eps": 1e-6}


def bind(fn, boundaries, extra):
    return lambda x, w: fn(x, w, **extra)


SPEC = OpSpec("rms_norm", reference="torch", check_inputs=check_inputs, bind=bind)
BACKENDS = (
    KernelBackend("rms_norm", "liger", liger_rms_norm, 100,
                  on_cuda_with(availability.has_liger, availability.LIGER_HINT), "liger_kernel"),
    # stock's own math: without Liger the model runs exactly as it would without the plugin
    KernelBackend("rms_norm", "torch", reference_rms_norm, 0, always),
)


@hookimpl
def fastqwen_kernel_backends():
    return list(BACKENDS)
