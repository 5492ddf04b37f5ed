"""e4m3 quantization of a GEMM input, in one kernel: one scale per row (per token), or one per
1x128 block of a row (`quantize_blocks`).

`q[m, k] = round(x[m, k] * c[k] * 448 / amax_m)` with `amax_m = max_k |x[m, k] * c[k]|` and the
dequantizing scale `amax_m / 448`, the layout `torch._scaled_mm` takes with row-wise scales. The
optional column factor `c` folds a per-channel weight scale into the input gradient (ops/fp8_linear.py
says why); with `groups`, `c` is one row of factors per group and row m takes `c[groups[m]]` (the
routed experts' rows, each with its expert's scales: ops/fp8_grouped.py). In eager PyTorch this is five full-size passes (abs, amax, multiply, clamp, cast), which
eat the FP8 GEMM's gain (0.77-1.04x on an H100, issue 35); the Triton kernel reads each row twice from
cache and writes it once. Rows past `rows_out` (the GEMM's 16-alignment) are zero with scale 1.

Block scales (DeepSeek-V3's 1x128 tiles) serve the output gradient `dy` of the input-gradient GEMM,
whose error is the one training feels (issue 35): a channel far above the rest of its row sets a
row's scale and pushes the row's small values toward e4m3's subnormals, where a block's own scale
keeps them at full precision. They are stored outer-dim-major (`[rows, blocks]` with stride
`(1, rows)`), the layout `torch._scaled_mm`'s block-scaled GEMM reads on Hopper.
"""

from __future__ import annotations

import functools

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0  # torch.finfo(float8_e4m3fn).max
ALIGN = 16  # torch._scaled_mm: every dimension a multiple of 16
BLOCK = 128  # the columns one block scale covers (torch._scaled_mm's BlockWise1x128)


def aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _rows_out(x: torch.Tensor, col_scale: torch.Tensor | None, rows_out: int | None,
              groups: torch.Tensor | None) -> int:
    """The quantized rows: `rows_out`, else the GEMM's 16-alignment, except for grouped rows (a grouped
    GEMM cuts them at its offsets: no padding). Checks `groups` against `col_scale` first."""
    if groups is not None and (col_scale is None or col_scale.dim() != 2 or groups.shape != x.shape[:1]
                               or col_scale.shape[1] != x.shape[1]):
        raise ValueError("groups: one group id per row of x, with col_scale [groups, columns]")
    if rows_out is not None:
        return rows_out
    return x.shape[0] if groups is not None else aligned(x.shape[0])


def quantize_rows_reference(x: torch.Tensor, col_scale: torch.Tensor | None = None, rows_out: int | None = None,
                            groups: torch.Tensor | None = None):
    """The same quantization in PyTorch (the CPU path and the kernel's oracle): (q [R, K] e4m3, scale [R, 1] fp32)."""
    rows, cols = x.shape
    rows_out = _rows_out(x, col_scale, rows_out, groups)
    v = x.float()
    if col_scale is not None:
        v = v * (col_scale.float()[groups.long()] if groups is not None else col_scale.float())
    amax = v.abs().amax(dim=1, keepdim=True)
    amax = torch.where(amax > 0, amax, torch.full_like(amax, E4M3_MAX))  # an all-zero row: scale 1
    q = torch.zeros(rows_out, cols, dtype=E4M3, device=x.device)
    scale = torch.ones(rows_out, 1, dtype=torch.float32, device=x.device)
    q[:rows] = (v * (E4M3_MAX / amax)).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    scale[:rows] = amax / E4M3_MAX
    return q, scale


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def quantize_rows_kernel(x_ptr, c_ptr, g_ptr, q_ptr, s_ptr, cols, stride_x, stride_q,
                             HAS_C: tl.constexpr, GROUPED: tl.constexpr, BLOCK: tl.constexpr, FP8_MAX: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        x_row = x_ptr + row * stride_x
        q_row = q_ptr + row * stride_q
        if GROUPED:  # this row's own factors: row `groups[row]` of c
            c_ptr = c_ptr + tl.load(g_ptr + row).to(tl.int64) * cols
        peak = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, cols, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < cols
            v = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
            if HAS_C:
                v = v * tl.load(c_ptr + offs, mask=mask, other=0.0)
            peak = tl.maximum(peak, tl.abs(v))
        amax = tl.max(peak, axis=0)
        amax = tl.where(amax > 0, amax, FP8_MAX)
        inv = FP8_MAX / amax
        for start in range(0, cols, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < cols
            v = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
            if HAS_C:
                v = v * tl.load(c_ptr + offs, mask=mask, other=0.0)
            v = tl.minimum(tl.maximum(v * inv, -FP8_MAX), FP8_MAX)
            tl.store(q_row + offs, v.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(s_ptr + row, amax / FP8_MAX)

    return quantize_rows_kernel


def _kernel_operands(x: torch.Tensor, col_scale: torch.Tensor | None, rows_out: int, scale: torch.Tensor):
    """What both kernels take besides the scales they fill: `x` with unit column stride, the e4m3
    output (rows past `x`'s are zero, their `scale` rows 1), and the column factor (`scale` stands in
    when there is none: the kernel does not read it then)."""
    rows, cols = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    q = torch.empty(rows_out, cols, dtype=E4M3, device=x.device)
    if rows_out > rows:
        q[rows:].zero_()
        scale[rows:].fill_(1.0)
    return x, q, col_scale.float().contiguous() if col_scale is not None else scale


def quantize_rows_triton(x: torch.Tensor, col_scale: torch.Tensor | None = None, rows_out: int | None = None,
                         groups: torch.Tensor | None = None):
    """The Triton kernel (CUDA): same contract as `quantize_rows_reference`."""
    rows, cols = x.shape
    rows_out = _rows_out(x, col_scale, rows_out, groups)
    scale = torch.empty(rows_out, 1, dtype=torch.float32, device=x.device)
    x, q, c = _kernel_operands(x, col_scale, rows_out, scale)
    if rows:
        _kernel()[(rows,)](x, c, groups.contiguous() if groups is not None else scale, q, scale, cols, x.stride(0),
                           q.stride(0), HAS_C=col_scale is not None, GROUPED=groups is not None,
                           BLOCK=min(4096, max(256, 1 << (cols - 1).bit_length())), FP8_MAX=E4M3_MAX,
                           num_warps=8)
    return q, scale


def quantize_rows(x: torch.Tensor, col_scale: torch.Tensor | None = None, rows_out: int | None = None,
                  groups: torch.Tensor | None = None):
    """Row-wise e4m3 quantization of a 2D tensor: the Triton kernel on CUDA, PyTorch elsewhere. With
    `groups` (one id per row), `col_scale` is `[groups, cols]` and the rows are not padded unless
    `rows_out` says so (grouped GEMMs take the rows as they are)."""
    if x.is_cuda:
        return quantize_rows_triton(x, col_scale, rows_out, groups)
    return quantize_rows_reference(x, col_scale, rows_out, groups)


def _block_scale_layout(rows_out: int, blocks: int, device) -> torch.Tensor:
    """`[rows_out, blocks]` fp32 with stride `(1, rows_out)`: outer-dim-major, as the GEMM reads it."""
    return torch.empty(blocks, rows_out, dtype=torch.float32, device=device).t()


def quantize_blocks_reference(x: torch.Tensor, col_scale: torch.Tensor | None = None, rows_out: int | None = None):
    """1x128-block quantization in PyTorch: (q [R, K] e4m3, scale [R, K/128] fp32, outer-dim-major);
    `q[m, k] * scale[m, k // 128]` is `x[m, k] * c[k]` rounded to e4m3."""
    rows, cols = x.shape
    if cols % BLOCK:
        raise ValueError(f"1x{BLOCK} block scales need the columns to be a multiple of {BLOCK}, not {cols}")
    rows_out = rows_out or aligned(rows)
    v = x.float()
    if col_scale is not None:
        v = v * col_scale.float()
    v = v.reshape(rows, cols // BLOCK, BLOCK)
    amax = v.abs().amax(dim=2, keepdim=True)
    amax = torch.where(amax > 0, amax, torch.full_like(amax, E4M3_MAX))
    q = torch.zeros(rows_out, cols, dtype=E4M3, device=x.device)
    q[:rows] = (v * (E4M3_MAX / amax)).clamp(-E4M3_MAX, E4M3_MAX).reshape(rows, cols).to(E4M3)
    scale = _block_scale_layout(rows_out, cols // BLOCK, x.device)
    scale.fill_(1.0)
    scale[:rows] = (amax / E4M3_MAX).reshape(rows, cols // BLOCK)
    return q, scale


@functools.cache
def _block_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def quantize_blocks_kernel(x_ptr, c_ptr, q_ptr, s_ptr, cols, rows_out, stride_x, stride_q,
                               HAS_C: tl.constexpr, GROUP: tl.constexpr, BLOCK_K: tl.constexpr,
                               FP8_MAX: tl.constexpr):
        # one row per program, GROUP blocks of BLOCK_K columns at a time: each block's amax is local,
        # so the row is read once
        row = tl.program_id(0).to(tl.int64)
        blocks = tl.arange(0, GROUP)
        inner = tl.arange(0, BLOCK_K)
        for first in range(0, cols // BLOCK_K, GROUP):
            block = first + blocks
            offs = block[:, None] * BLOCK_K + inner[None, :]
            mask = offs < cols
            v = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
            if HAS_C:
                v = v * tl.load(c_ptr + offs, mask=mask, other=0.0)
            amax = tl.max(tl.abs(v), axis=1)
            amax = tl.where(amax > 0, amax, FP8_MAX)
            q = tl.minimum(tl.maximum(v * (FP8_MAX / amax)[:, None], -FP8_MAX), FP8_MAX)
            tl.store(q_ptr + row * stride_q + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
            tl.store(s_ptr + block.to(tl.int64) * rows_out + row, amax / FP8_MAX, mask=block < cols // BLOCK_K)

    return quantize_blocks_kernel


def quantize_blocks_triton(x: torch.Tensor, col_scale: torch.Tensor | None = None, rows_out: int | None = None):
    """The Triton kernel (CUDA): same contract as `quantize_blocks_reference`."""
    rows, cols = x.shape
    if cols % BLOCK:
        raise ValueError(f"1x{BLOCK} block scales need the columns to be a multiple of {BLOCK}, not {cols}")
    rows_out = rows_out or aligned(rows)
    scale = _block_scale_layout(rows_out, cols // BLOCK, x.device)
    x, q, c = _kernel_operands(x, col_scale, rows_out, scale)
    if rows:
        _block_kernel()[(rows,)](x, c, q, scale, cols, rows_out, x.stride(0), q.stride(0),
                                 HAS_C=col_scale is not None, GROUP=8, BLOCK_K=BLOCK, FP8_MAX=E4M3_MAX,
                                 num_warps=4)
    return q, scale


def quantize_blocks(x: torch.Tensor, col_scale: torch.Tensor | None = None, rows_out: int | None = None):
    """1x128-block e4m3 quantization of a 2D tensor: the Triton kernel on CUDA, PyTorch elsewhere."""
    if x.is_cuda:
        return quantize_blocks_triton(x, col_scale, rows_out)
    return quantize_blocks_reference(x, col_scale, rows_out)
