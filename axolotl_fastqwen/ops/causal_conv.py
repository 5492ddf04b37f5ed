"""The short causal depthwise conv in front of the Gated DeltaNet recurrence, boundary-exact.

A conv of width W reads the W-1 tokens before each position. In a packed row those can belong to
the previous sequence; every backend here cuts the window at sequence starts: causal-conv1d
through `seq_idx`, fla's Triton conv through `cu_seqlens`, the reference by masking the taps.
"""

from __future__ import annotations

import torch.nn.functional as F

from ..hookspecs import hookimpl
from . import availability
from .backend import CheckShapes, KernelBackend, OpSpec, always, generator, on_cuda_with, randn


def causal_conv1d_cuda(x, weight, bias, *, activation, boundaries):
    """causal-conv1d's CUDA kernel; sequence starts through `seq_idx`. x `[B, T, D]`, weight `[D, W]`."""
    from causal_conv1d import causal_conv1d_fn

    # channel-last view [B, D, T] (stride(1) == 1): required by causal-conv1d together with seq_idx
    seq_idx = boundaries.seq_idx if boundaries is not None else None
    out = causal_conv1d_fn(
        x.transpose(1, 2), weight, bias, seq_idx=seq_idx, activation="silu" if activation else None
    )
    return out.transpose(1, 2)


def fla_triton_causal_conv(x, weight, bias, *, activation, boundaries):
    """fla's Triton conv; sequence starts through `cu_seqlens`."""
    try:
        from fla.modules.convolution import causal_conv1d
    except ImportError:  # fla >= 0.6 moved it; the alias above is kept, this is belt and braces
        from fla.modules.causal_conv1d import causal_conv1d

    varlen = boundaries.fla_varlen() if boundaries is not None else {}
    out, _ = causal_conv1d(
        x, weight=weight, bias=bias, activation="silu" if activation else None, backend="triton", **varlen
    )
    return out


def reference_causal_conv(x, weight, bias=None, *, activation=None, boundaries=None):
    """PyTorch causal conv. Without boundaries it is exactly the stock layer's `F.conv1d`; with
    boundaries each tap j is masked where the token is fewer than j places into its sequence."""
    width = weight.shape[-1]
    if boundaries is None:
        out = F.conv1d(
            x.transpose(1, 2).to(weight.dtype), weight.unsqueeze(1), bias, padding=width - 1, groups=x.shape[-1]
        )[..., : x.shape[1]].transpose(1, 2)
    else:
        offset = boundaries.position_in_sequence().to(x.device).view(1, -1, 1)
        xw = x.to(weight.dtype)
        out = xw * weight[:, width - 1]
        for j in range(1, width):  # tap j reads the token j places back
            shifted = F.pad(xw, (0, 0, j, 0))[:, : x.shape[1]]
            out = out + shifted * weight[:, width - 1 - j] * (offset >= j)
        if bias is not None:
            out = out + bias
    if activation is not None:
        out = F.silu(out)
    return out.to(x.dtype)


def check_inputs(shapes: CheckShapes, device, tokens: int):
    """The conv input [1, T, conv_dim] and its depthwise weight [conv_dim, width]; SiLU on."""
    gen = generator(device)
    D = 2 * shapes.key_heads * shapes.key_dim + shapes.value_heads * shapes.value_dim
    return [randn(gen, device, 1, tokens, D), randn(gen, device, D, shapes.conv_width, scale=0.5)], {"activation": "silu"}


def bind(fn, boundaries, extra):
    return lambda x, w: fn(x, w, None, boundaries=boundaries, **extra)


SPEC = OpSpec("causal_conv", reference="torch", check_inputs=check_inputs, bind=bind)
_FLA = on_cuda_with(availability.has_fla, availability.FLA_HINT)
BACKENDS = (
    KernelBackend("causal_conv", "causal-conv1d", causal_conv1d_cuda, 100,
                  on_cuda_with(availability.has_causal_conv1d, "build causal-conv1d: README, 'Kernels on a GPU machine'"),
                  "causal_conv1d"),
    KernelBackend("causal_conv", "fla-triton", fla_triton_causal_conv, 50, _FLA, "fla"),
    KernelBackend("causal_conv", "torch", reference_causal_conv, 0, always, fallback=True),
)


@hookimpl
def fastqwen_kernel_backends():
    return list(BACKENDS)
