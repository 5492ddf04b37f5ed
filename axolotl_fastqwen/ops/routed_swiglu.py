"""The routed experts' activation with the routing weight: `silu(gate) · up · w` per routed row, in one
kernel each way.

Each row routed to an expert holds `[gate | up]` (the concatenated `gate_up_proj` output, 2·I wide)
and its token's routing weight `w` for that expert. Unfused this is four elementwise passes over the
`[rows, I]` intermediate forward (silu, the product, the weight's cast, the weighting) and seven
backward (their gradients, the routing weight's row sum and the copy that joins the gate's and up's
gradients), with three such intermediates held for backward. Here one forward kernel reads `[gate |
up]` and `w` and writes the weighted activation; one backward kernel recomputes the activation from
the same inputs and writes `d[gate | up]` and `dw`. Only the inputs are held for backward. The
arithmetic is fp32 inside the kernel, rounded once on the way out (the unfused path rounds after each
op): the reference below is that fp32 math.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

BLOCK_M = 8  # rows a program takes
BLOCK_N = 256  # columns a program takes (forward) or steps through (backward)


def routed_swiglu_reference(gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """(rows, 2·I) `[gate | up]`, (rows,) routing weights -> (rows, I) `silu(gate) · up · w`, in fp32
    and rounded once to `gate_up`'s dtype: the kernels' oracle (the CPU path is the module's own gate,
    `layers/grouped_experts.py`)."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (F.silu(gate) * up * weight.float().unsqueeze(-1)).to(gate_up.dtype)


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def forward_kernel(gu_ptr, w_ptr, out_ptr, rows, inter, stride_gu, stride_out,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        c = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = r < rows
        mask = row_ok[:, None] & (c < inter)[None, :]
        r64 = r.to(tl.int64)[:, None]
        gate = tl.load(gu_ptr + r64 * stride_gu + c[None, :], mask=mask, other=0.0).to(tl.float32)
        up = tl.load(gu_ptr + r64 * stride_gu + inter + c[None, :], mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + r, mask=row_ok, other=0.0).to(tl.float32)
        y = gate * tl.sigmoid(gate) * up * w[:, None]
        tl.store(out_ptr + r64 * stride_out + c[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def backward_kernel(gu_ptr, w_ptr, dy_ptr, dgu_ptr, dw_ptr, rows, inter, stride_gu, stride_dy, stride_dgu,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = r < rows
        r64 = r.to(tl.int64)[:, None]
        w = tl.load(w_ptr + r, mask=row_ok, other=0.0).to(tl.float32)
        dw = tl.zeros([BLOCK_M], dtype=tl.float32)
        for start in range(0, inter, BLOCK_N):
            c = start + tl.arange(0, BLOCK_N)
            mask = row_ok[:, None] & (c < inter)[None, :]
            gate = tl.load(gu_ptr + r64 * stride_gu + c[None, :], mask=mask, other=0.0).to(tl.float32)
            up = tl.load(gu_ptr + r64 * stride_gu + inter + c[None, :], mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + r64 * stride_dy + c[None, :], mask=mask, other=0.0).to(tl.float32)
            sig = tl.sigmoid(gate)
            silu = gate * sig
            dw += tl.sum(dy * silu * up, axis=1)
            dyw = dy * w[:, None]
            d_gate = dyw * up * sig * (1.0 + gate * (1.0 - sig))
            d_up = dyw * silu
            out_ty = dgu_ptr.dtype.element_ty
            tl.store(dgu_ptr + r64 * stride_dgu + c[None, :], d_gate.to(out_ty), mask=mask)
            tl.store(dgu_ptr + r64 * stride_dgu + inter + c[None, :], d_up.to(out_ty), mask=mask)
        tl.store(dw_ptr + r, dw, mask=row_ok)

    return forward_kernel, backward_kernel


def _rows(t: torch.Tensor) -> torch.Tensor:
    """Rows with unit column stride (the kernels index `row * stride + column`)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def routed_swiglu_forward_triton(gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    import triton

    gate_up, weight = _rows(gate_up), weight.contiguous()
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, inter, dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        grid = (triton.cdiv(rows, BLOCK_M), triton.cdiv(inter, BLOCK_N))
        _kernels()[0][grid](gate_up, weight, out, rows, inter, gate_up.stride(0), out.stride(0),
                            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)
    return out


def routed_swiglu_backward_triton(gate_up: torch.Tensor, weight: torch.Tensor, grad: torch.Tensor):
    """(d[gate | up] in `gate_up`'s dtype, dw in fp32)."""
    import triton

    gate_up, weight, grad = _rows(gate_up), weight.contiguous(), _rows(grad)
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    d_gate_up = torch.empty_like(gate_up)
    d_weight = torch.empty(rows, dtype=torch.float32, device=gate_up.device)
    if rows:
        _kernels()[1][(triton.cdiv(rows, BLOCK_M),)](
            gate_up, weight, grad, d_gate_up, d_weight, rows, inter, gate_up.stride(0), grad.stride(0),
            d_gate_up.stride(0), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)
    return d_gate_up, d_weight


class RoutedSwiGLU(torch.autograd.Function):
    """The Triton kernels with autograd: holds `[gate | up]` and `w` for backward, nothing wider."""

    @staticmethod
    def forward(ctx, gate_up, weight):
        ctx.save_for_backward(gate_up, weight)
        return routed_swiglu_forward_triton(gate_up, weight)

    @staticmethod
    def backward(ctx, grad):
        gate_up, weight = ctx.saved_tensors
        d_gate_up, d_weight = routed_swiglu_backward_triton(gate_up, weight, grad)
        return (d_gate_up if ctx.needs_input_grad[0] else None,
                d_weight.to(weight.dtype) if ctx.needs_input_grad[1] else None)


def routed_swiglu_triton(gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """(rows, 2·I), (rows,) -> (rows, I), differentiable in both: one Triton kernel each way."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or weight.shape != gate_up.shape[:1]:
        raise ValueError(f"routed_swiglu: gate_up (rows, 2·I) and one weight per row, got {tuple(gate_up.shape)} "
                         f"and {tuple(weight.shape)}")
    return RoutedSwiGLU.apply(gate_up, weight)
