"""Causal attention over a packed row, one sequence at a time, never a T x T mask.

flash-attn's varlen kernel when installed, else PyTorch's own varlen attention (FlashAttention-2
inside PyTorch >= 2.10, CUDA, bf16/fp16), else per-sequence SDPA (the CPU and fp32 path).
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F

from ..hookspecs import hookimpl
from . import availability
from .backend import CheckShapes, KernelBackend, OpSpec, always, generator, on_cuda_with, randn


def flash_attn_varlen(q, k, v, *, boundaries, scale, dropout=0.0):
    """flash-attn's varlen kernel. q `[T, Hq, D]`, k/v `[T, Hkv, D]`; returns `[T, Hq, D]`."""
    from flash_attn import flash_attn_varlen_func

    cu, n = boundaries.cu_seqlens, boundaries.max_seqlen
    return flash_attn_varlen_func(q, k, v, cu, cu, n, n, dropout_p=dropout, softmax_scale=scale, causal=True)


def torch_varlen(q, k, v, *, boundaries, scale, dropout=0.0):
    """PyTorch's varlen attention (bf16/fp16, no dropout: `torch_varlen_limits`)."""
    return _torch_varlen(q, k, v, boundaries, scale)


def torch_varlen_limits(q, k, v, *, boundaries=None, scale=None, dropout=0.0) -> str | None:
    """PyTorch's varlen kernel has no attention dropout and no fp32: such calls run the reference."""
    if dropout:
        return f"attention dropout {dropout:g} (PyTorch's varlen attention has none)"
    if q.dtype not in (torch.bfloat16, torch.float16):
        return f"{str(q.dtype).replace('torch.', '')} inputs (PyTorch's varlen attention runs bf16/fp16 only)"
    return None


@functools.cache
def _torch_varlen_params() -> frozenset[str]:
    from torch.nn.attention.varlen import varlen_attn

    return frozenset(inspect.signature(varlen_attn).parameters)


def _torch_varlen(q, k, v, boundaries, scale):
    from torch.nn.attention.varlen import varlen_attn

    params = _torch_varlen_params()
    kwargs = {"scale": scale}
    # the causal switch changed name across PyTorch releases
    if "window_size" in params:
        kwargs["window_size"] = (-1, 0)
    else:
        kwargs["is_causal"] = True
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            groups = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    cu = boundaries.cu_seqlens
    n = boundaries.max_seqlen
    return varlen_attn(q, k, v, cu, cu, n, n, **kwargs)


def reference_varlen_attention(q, k, v, *, boundaries, scale, dropout=0.0):
    """Per-sequence causal SDPA; each sequence sees only itself."""
    groups = q.shape[1] // k.shape[1]
    out = torch.empty_like(q)
    cu = boundaries.cu_seqlens_host.tolist()
    for start, end in zip(cu[:-1], cu[1:]):
        qs, ks, vs = (t[start:end].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        if groups > 1:
            ks, vs = ks.repeat_interleave(groups, dim=1), vs.repeat_interleave(groups, dim=1)
        o = F.scaled_dot_product_attention(qs, ks, vs, dropout_p=dropout, is_causal=True, scale=scale)
        out[start:end] = o[0].transpose(0, 1)
    return out


def check_inputs(shapes: CheckShapes, device, tokens: int):
    """q [T, Hq, D], k and v [T, Hkv, D] of a packed row."""
    gen, D = generator(device), shapes.head_dim
    return [randn(gen, device, tokens, shapes.q_heads, D), randn(gen, device, tokens, shapes.kv_heads, D),
            randn(gen, device, tokens, shapes.kv_heads, D)], {"scale": D**-0.5}


def bind(fn, boundaries, extra):
    return lambda q, k, v: fn(q, k, v, boundaries=boundaries, **extra)


SPEC = OpSpec("varlen_attention", reference="torch", check_inputs=check_inputs, bind=bind)
BACKENDS = (
    KernelBackend("varlen_attention", "flash-attn", flash_attn_varlen, 100,
                  on_cuda_with(availability.has_flash_attn, "pip install flash-attn"), "flash_attn"),
    KernelBackend("varlen_attention", "torch-varlen", torch_varlen, 50,
                  on_cuda_with(availability.has_torch_varlen, "needs torch>=2.10 with torch.nn.attention.varlen"),
                  limits=torch_varlen_limits),
    KernelBackend("varlen_attention", "torch", reference_varlen_attention, 0, always, fallback=True),
)


@hookimpl
def fastqwen_kernel_backends():
    return list(BACKENDS)
