"""The gated RMSNorm after the recurrence: `rmsnorm(x) * weight * silu(z)`, per value head.

Stock transformers runs it as ~10 elementwise kernels in fp32; fla fuses it into one forward and
one backward kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..hookspecs import hookimpl
from . import availability
from .backend import CheckShapes, KernelBackend, OpSpec, always, generator, on_cuda_with, randn


def fla_gated_rmsnorm(x, z, weight, *, eps):
    """fla's fused gated RMSNorm (one kernel each way). x, z `[..., D]`, weight `[D]`."""
    try:
        from fla.modules.fused_norm_gate import rms_norm_gated
    except ImportError:
        from fla.modules.norm.fused_norm_gate import rms_norm_gated
    shape = x.shape
    out = rms_norm_gated(x.reshape(-1, shape[-1]), z.reshape(-1, shape[-1]), weight, None, "silu", eps=eps)
    return out.reshape(shape)


def reference_gated_rmsnorm(x, z, weight, *, eps):
    """The stock Qwen computation, cast for cast: normalise in fp32, scale in the input dtype,
    gate in fp32."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = weight * h.to(dtype)
    h = h * F.silu(z.float())
    return h.to(dtype)


def check_inputs(shapes: CheckShapes, device, tokens: int):
    """x, z [1, T, Hv, Dv] and a weight near 1 (the trained gated norm's range)."""
    gen, Hv, Dv = generator(device), shapes.value_heads, shapes.value_dim
    return [randn(gen, device, 1, tokens, Hv, Dv), randn(gen, device, 1, tokens, Hv, Dv),
            1 + randn(gen, device, Dv, scale=0.1)], {"eps": 1e-6}


def bind(fn, boundaries, extra):
    return lambda x, z, w: fn(x, z, w, **extra)


SPEC = OpSpec("gated_rmsnorm", reference="torch", check_inputs=check_inputs, bind=bind)
BACKENDS = (
    KernelBackend("gated_rmsnorm", "fla", fla_gated_rmsnorm, 100,
                  on_cuda_with(availability.has_fla, availability.FLA_HINT), "fla"),
    KernelBackend("gated_rmsnorm", "torch", reference_gated_rmsnorm, 0, always, fallback=True),
)


@hookimpl
def fastqwen_kernel_backends():
    return list(BACKENDS)
