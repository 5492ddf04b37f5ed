"""A token's k routed rows summed back into the token, in one kernel: `out[t] = Σⱼ src[unsort[t·k + j]]`
(plus a second source's same rows, when given).

The routed experts compute on rows sorted by expert; each token's k rows are then gathered back to
token order and summed. In PyTorch that is a gather that writes all `[T·k, H]` rows again, then a
reduction that reads them once more; the input's gradient needs the same thing (the routed rows'
gradient summed per token). Here each program gathers a token's k rows straight into an fp32
accumulator, in the order j = 0..k-1 (deterministic), and writes the token once. With expert LoRA
on the down projection, the adapter's rows are the second source: their add, a full `[T·k, H]`
pass, is folded into the same sum.
"""

from __future__ import annotations

import functools

import torch

BLOCK_H = 512  # columns a program takes


def routed_combine_torch(src: torch.Tensor, unsort: torch.Tensor, k: int,
                         extra: torch.Tensor | None = None) -> torch.Tensor:
    """(T·k, H) rows in expert order -> (T, H), each token's k rows summed, in PyTorch's ops (a CPU, or
    where the kernel is not used): `extra`'s rows added first, a gather, then a sum (fp32 inside, one
    rounding)."""
    rows = src if extra is None else src + extra
    return rows[unsort].view(-1, k, src.shape[-1]).sum(dim=1)


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def combine_kernel(src_ptr, extra_ptr, unsort_ptr, out_ptr, k, cols, stride_src, stride_extra, stride_out,
                       HAS_EXTRA: tl.constexpr, BLOCK_H: tl.constexpr):
        token = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        mask = c < cols
        acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        for j in range(0, k):
            row = tl.load(unsort_ptr + token * k + j).to(tl.int64)
            acc += tl.load(src_ptr + row * stride_src + c, mask=mask, other=0.0).to(tl.float32)
            if HAS_EXTRA:
                acc += tl.load(extra_ptr + row * stride_extra + c, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + token * stride_out + c, acc.to(out_ptr.dtype.element_ty), mask=mask)

    return combine_kernel


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def routed_combine_triton(src: torch.Tensor, unsort: torch.Tensor, k: int,
                          extra: torch.Tensor | None = None) -> torch.Tensor:
    """The same, in one Triton kernel (not differentiable: the callers' autograd functions use it)."""
    import triton

    if src.dim() != 2 or unsort.shape != src.shape[:1] or src.shape[0] % k:
        raise ValueError(f"routed_combine: src (T·k, H) and one index per row, got {tuple(src.shape)}, "
                         f"{tuple(unsort.shape)}, k={k}")
    if extra is not None and extra.shape != src.shape:
        raise ValueError(f"routed_combine: extra {tuple(extra.shape)} must match src {tuple(src.shape)}")
    src, unsort = _rows(src), unsort.contiguous()
    extra = _rows(extra) if extra is not None else None
    tokens, cols = src.shape[0] // k, src.shape[1]
    out = torch.empty(tokens, cols, dtype=src.dtype, device=src.device)
    if tokens:
        _kernel()[(tokens, triton.cdiv(cols, BLOCK_H))](
            src, extra if extra is not None else src, unsort, out, k, cols, src.stride(0),
            extra.stride(0) if extra is not None else 0, out.stride(0), HAS_EXTRA=extra is not None, BLOCK_H=BLOCK_H)
    return out
