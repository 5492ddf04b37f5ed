"""Causal attention over a packed row, one sequence at a time, never a T x T mask.

On a GPU, sequences of at least `LONG_SEQUENCE` tokens run one at a time on SDPA with cuDNN's fused
attention first, and each run of shorter ones between them in one varlen call: at the 27B's head
shape (24 query / 4 key-value heads, dim 256) cuDNN's kernel is 1.6x PyTorch's varlen
FlashAttention-2 forward + backward on single sequences of 16k-128k tokens (H100, 365 against 228
TFLOP/s; benchmarks/h100/2026-12-06e), and a row of short sequences is one varlen call as before.
Then flash-attn's varlen kernel when installed, else PyTorch's own varlen attention
(FlashAttention-2 inside PyTorch >= 2.10, CUDA, bf16/fp16), else per-sequence SDPA (the CPU and
fp32 path).
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F

from torch.nn.attention import SDPBackend, sdpa_kernel

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


LONG_SEQUENCE = 4096  # from this length a sequence runs alone on SDPA's cuDNN kernel
SELF_CHECK_LONG = 64  # the self-check's row has no long sequence: it splits at this length instead
SDPA_ORDER = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION]  # SDPA's choice, in this order


def long_sequences_on_sdpa(q, k, v, *, boundaries, scale, dropout=0.0, short=None):
    """Each sequence of at least `LONG_SEQUENCE` tokens alone through causal SDPA (cuDNN's kernel
    first), each run of shorter ones between them in one varlen call (`short`, default PyTorch's
    varlen kernel) over that run's tokens. A row without a long sequence is one varlen call. The
    self-check's row (`boundaries.source == "self-check"`) splits at `SELF_CHECK_LONG` tokens, so
    that both paths are proven on this GPU."""
    short = short or torch_varlen
    long_from = SELF_CHECK_LONG if boundaries.source == "self-check" else LONG_SEQUENCE
    if boundaries.max_seqlen < long_from:
        return short(q, k, v, boundaries=boundaries, scale=scale, dropout=dropout)
    cu = boundaries.cu_seqlens_host.tolist()
    pieces, run_start = [], 0  # run_start: index of the first sequence of the current run of short ones
    for i in range(len(cu) - 1):
        if cu[i + 1] - cu[i] < long_from:
            continue
        if run_start < i:
            pieces.append(short(*(t[cu[run_start]:cu[i]] for t in (q, k, v)), scale=scale, dropout=dropout,
                                boundaries=boundaries.window(run_start, i)))
        pieces.append(_sdpa_causal(q[cu[i]:cu[i + 1]], k[cu[i]:cu[i + 1]], v[cu[i]:cu[i + 1]], scale))
        run_start = i + 1
    if run_start < len(cu) - 1:
        pieces.append(short(*(t[cu[run_start]:] for t in (q, k, v)), scale=scale, dropout=dropout,
                            boundaries=boundaries.window(run_start, len(cu) - 1)))
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def _sdpa_causal(q, k, v, scale):
    """One sequence `[L, H, D]` through causal SDPA, key-value heads shared by query groups."""
    qs, ks, vs = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    with sdpa_kernel(SDPA_ORDER, set_priority=True):
        out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale,
                                             enable_gqa=q.shape[1] != k.shape[1])
    return out[0].transpose(0, 1)


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
    KernelBackend("varlen_attention", "cudnn-long+torch-varlen", long_sequences_on_sdpa, 110,
                  on_cuda_with(availability.has_torch_varlen, "needs torch>=2.10 with torch.nn.attention.varlen"),
                  limits=torch_varlen_limits),
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
