"""A LoRA linear layer as one autograd function: `y = x·Wᵀ (+ b) + s·(x·Aᵀ)·Bᵀ`, the adapter's
product accumulated into the base output by the GEMM itself, and both branches' input gradients
accumulated the same way.

peft runs the adapter as separate modules: the base output, `B(A(x))`, a multiply by the scaling and
an add, each a full-size `[tokens, out]` pass, and in backward the multiply again plus autograd's sum
of the two input gradients (`[tokens, in]`). On the 35B-A3B profile with expert LoRA those bf16 adds
and scalar multiplies were 119 ms of 656 ms of GPU kernel time a step (2,498 and 1,386 launches,
benchmarks/h200/2026-12-04d). Here `addmm_` adds `s·low·Bᵀ` in the GEMM's epilogue (cuBLAS beta=1)
and backward does `dx = dy·W` then `dx.addmm_(s·dy·B, A)`: the only elementwise work left is on
`[tokens, rank]` tensors. Axolotl's LoRA kernels (`axolotl/kernels/lora.py`) do the same for the
MLP and attention blocks they patch; this covers every other adapted projection.

The frozen base runs as `DenseBase` (its bf16 weight) or `Fp8Base` (`fastqwen_fp8`: its FP8 GEMMs,
`ops/fp8_linear.py`). The result is peft's up to rounding: the adapter's product is added in the
GEMM's fp32 accumulator instead of after a bf16 rounding of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .fp8_linear import Fp8Weight, InputCache, compute_input_gradient, forward_rows


@dataclass
class DenseBase:
    """A frozen `nn.Linear`'s weight `[N, K]` and bias, in the compute dtype."""

    weight: torch.Tensor
    bias: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
        return F.linear(x2, self.weight, self.bias)

    def input_gradient(self, dy2: torch.Tensor) -> torch.Tensor:
        return dy2 @ self.weight


@dataclass
class Fp8Base:
    """A frozen projection quantized by `fastqwen_fp8`: its e4m3 weight, the shared-input cache and how
    its input gradient runs."""

    weight: Fp8Weight
    cache: InputCache | None
    how: str
    bias: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
        y = forward_rows(x, self.weight, self.cache).to(x2.dtype)
        return y + self.bias.to(y.dtype) if self.bias is not None else y

    def input_gradient(self, dy2: torch.Tensor) -> torch.Tensor:
        return compute_input_gradient(dy2, self.weight, self.how).to(dy2.dtype)


class _LoraLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, a, b, base, scaling: float, dtype: torch.dtype):
        x2 = x.reshape(-1, x.shape[-1]).to(dtype)
        a_c, b_c = a.to(dtype), b.to(dtype)
        with torch.autocast(x.device.type, enabled=False):
            y = base.forward(x, x2)
            low = x2 @ a_c.t()  # [R, rank]
            y = y.addmm_(low, b_c.t(), alpha=scaling) if y.is_contiguous() else torch.addmm(y, low, b_c.t(), alpha=scaling)
        ctx.save_for_backward(x2 if ctx.needs_input_grad[1] else None, low, a_c, b_c)
        ctx.base, ctx.scaling, ctx.shape, ctx.x_dtype = base, scaling, x.shape, x.dtype
        ctx.dtypes = (a.dtype, b.dtype)
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        x2, low, a_c, b_c = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1]).to(a_c.dtype)
        dlow = (dy2 @ b_c).mul_(ctx.scaling)  # [R, rank]: the only elementwise pass, on the rank
        da = (dlow.t() @ x2).to(ctx.dtypes[0]) if ctx.needs_input_grad[1] else None
        db = (dy2.t() @ low).mul_(ctx.scaling).to(ctx.dtypes[1]) if ctx.needs_input_grad[2] else None
        dx = None
        if ctx.needs_input_grad[0]:
            dx = ctx.base.input_gradient(dy2).addmm_(dlow, a_c)
            dx = dx.to(ctx.x_dtype).reshape(ctx.shape)
        return dx, da, db, None, None, None


def lora_linear(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, base: DenseBase | Fp8Base, scaling: float,
                dtype: torch.dtype) -> torch.Tensor:
    """`base(x) + scaling·(x·aᵀ)·bᵀ` in `dtype` (a `[rank, K]`, b `[N, rank]`: peft's lora_A / lora_B
    weights); the base gets no gradient, `x`, `a` and `b` theirs (in their own dtypes)."""
    return _LoraLinear.apply(x, a, b, base, scaling, dtype)
