"""The FP8 weight's transposed copy, made per backward: one tiled Triton copy at memory speed.

Hopper's FP8 GEMM takes both operands K-major, so the input gradient `dy·W` needs `W_q` laid out
`[K, N]` where the forward reads `[N, K]`. Keeping that copy costs a byte a parameter (the memory
FP8 storage was to free); making it per backward costs one read and one write of the weight. PyTorch's
generic strided copy does that at ~180 GB/s for a one-byte dtype (H100, 17408x5120: 0.5 ms, a third of
the FP8 GEMM pair's gain at 8k tokens); a tiled kernel runs it near the memory bandwidth.
"""

from __future__ import annotations

import functools

import torch

TILE = 64


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def transpose_kernel(src, dst, rows, cols, TILE_R: tl.constexpr, TILE_C: tl.constexpr):
        r = tl.program_id(0).to(tl.int64) * TILE_R + tl.arange(0, TILE_R)
        c = tl.program_id(1).to(tl.int64) * TILE_C + tl.arange(0, TILE_C)
        matrix = tl.program_id(2).to(tl.int64) * rows * cols  # one matrix of a stack (the routed experts') per z
        src += matrix
        dst += matrix
        mask = (r[:, None] < rows) & (c[None, :] < cols)
        tile = tl.load(src + r[:, None] * cols + c[None, :], mask=mask)
        tl.store(dst + c[:, None] * rows + r[None, :], tl.trans(tile), mask=tl.trans(mask))

    return transpose_kernel


def transpose_triton(x: torch.Tensor) -> torch.Tensor:
    """`x.transpose(-2, -1).contiguous()` of a contiguous 2D one-byte tensor (e4m3), or a stack of
    them `[E, rows, cols]`, on CUDA."""
    *stack, rows, cols = x.shape
    out = torch.empty(*stack, cols, rows, dtype=x.dtype, device=x.device)
    grid = (-(-rows // TILE), -(-cols // TILE), stack[0] if stack else 1)
    _kernel()[grid](x.view(torch.uint8), out.view(torch.uint8), rows, cols, TILE_R=TILE, TILE_C=TILE, num_warps=4)
    return out


def transpose(x: torch.Tensor) -> torch.Tensor:
    """The transposed copy (of the last two dimensions, 2D or 3D): the Triton kernel on CUDA,
    PyTorch's copy elsewhere."""
    if x.is_cuda and x.is_contiguous() and x.dim() in (2, 3):
        return transpose_triton(x)
    return x.transpose(-2, -1).contiguous()
