"""The gated RMSNorm after the recurrence: `rmsnorm(x) * weight * silu(z)`, per value head.

Stock transformers runs it as ~10 elementwise kernels in fp32; fla fuses it into one forward and
one backward kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

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
