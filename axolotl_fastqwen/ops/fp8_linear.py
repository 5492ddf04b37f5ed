"""`y = x·Wᵀ` on FP8 tensor cores for a frozen weight (a LoRA base): the forward and the input
gradient `dx = dy·W`, never a weight gradient.

A LoRA base never changes, so its weight is quantized once (`Fp8Weight`: e4m3, one scale per output
channel) and its bf16 copy can go; each step quantizes only the activation and the output gradient,
per token (`ops/fp8_quantize.py`). Both GEMMs are `torch._scaled_mm` with row-wise scales (cuBLASLt
on Hopper). The input gradient contracts over the output channels, where the weight's scales live:
`dy·W = (dy·diag(s))·W_q`, so the scales are folded into `dy` as it is quantized, and the GEMM runs
on `W_q` as stored, transposed to the K-major layout Hopper's FP8 GEMM needs: either kept (a second
FP8 copy: 2 bytes a parameter, as bf16) or made per backward (1 byte a parameter, one transposing copy
per call, `ops/fp8_transpose.py`); `Fp8Weight.transposed` says which. The forward accumulates like torchao's row-wise recipe
(fast accumulation forward, full-precision backward).

Projections that read the same input (gate/up, q/k/v, the Gated DeltaNet's in-projections) quantize
it once (`InputCache`).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from .fp8_quantize import BLOCK, E4M3, E4M3_MAX, aligned, quantize_blocks, quantize_rows
from .fp8_transpose import transpose

# torch._scaled_mm with row-wise scales on CUDA: Hopper (sm_90) or newer
MIN_CAPABILITY = (9, 0)


@dataclass
class Fp8Weight:
    """A frozen `[N, K]` weight as e4m3 `data` with a per-output-channel `scale` ([1, N] fp32):
    W ≈ data · scale per row. `transposed` ([K, N], e4m3) is the input gradient's layout when kept."""

    data: torch.Tensor
    scale: torch.Tensor
    transposed: torch.Tensor | None = None

    @classmethod
    def quantize(cls, weight: torch.Tensor, keep_transposed: bool = False) -> Fp8Weight:
        w = weight.detach()
        amax = w.abs().amax(dim=1, keepdim=True).float()
        amax = torch.where(amax > 0, amax, torch.full_like(amax, E4M3_MAX))
        data = (w.float() * (E4M3_MAX / amax)).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
        out = cls(data=data, scale=(amax / E4M3_MAX).reshape(1, -1).contiguous())
        if keep_transposed:
            out.transposed = data.t().contiguous()
        return out

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.data, self.scale, self.transposed) if t is not None)

    def input_gradient_layout(self) -> torch.Tensor:
        """`W_q` as `[K, N]` row-major (so that `.t()` is the column-major `[N, K]` operand)."""
        return self.transposed if self.transposed is not None else transpose(self.data)


class InputCache:
    """The last input quantized, while that very tensor is alive and unmodified: projections that
    share an input quantize it once. One entry, so it holds one quantized activation at most."""

    def __init__(self):
        self._source = None
        self._version = -1
        self._value = None

    def get(self, x: torch.Tensor, rows_out: int):
        source = self._source() if self._source is not None else None
        if source is x and x._version == self._version and self._value[0].shape[0] == rows_out:
            return self._value
        value = quantize_rows(x.reshape(-1, x.shape[-1]), rows_out=rows_out)
        self._source, self._version, self._value = weakref.ref(x), x._version, value
        return value

    def clear(self) -> None:
        self._source, self._value = None, None


def forward_gemm(xq: torch.Tensor, sx: torch.Tensor, weight: Fp8Weight) -> torch.Tensor:
    """`x·Wᵀ` of a quantized `[R, K]` input (bf16 `[R, N]`), with fast accumulation as torchao's forward."""
    return torch._scaled_mm(xq, weight.data.t(), scale_a=sx, scale_b=weight.scale, out_dtype=torch.bfloat16,
                            use_fast_accum=True)


def input_gradient_gemm(dy: torch.Tensor, weight: Fp8Weight) -> torch.Tensor:
    """`dy·W` of a 2D output gradient `[M, N]`: dy quantized per token with the weight's scales folded
    in, then the FP8 GEMM on `W_q` in its K-major layout (bf16 `[aligned(M), K]`)."""
    dq, sd = quantize_rows(dy, col_scale=weight.scale.reshape(-1))
    ones = torch.ones(1, weight.data.shape[1], dtype=torch.float32, device=dy.device)
    return torch._scaled_mm(dq, weight.input_gradient_layout().t(), scale_a=sd, scale_b=ones,
                            out_dtype=torch.bfloat16)


def block_scaled_input_gradient_gemm(dy: torch.Tensor, weight: Fp8Weight) -> torch.Tensor:
    """`input_gradient_gemm` with dy's scales per 1x128 block of the contracted dimension (`ops/fp8_quantize.py` says
    why): cuBLAS's block-scaled FP8 GEMM (sm_90, CUDA 12.9+) with `W_q`'s side at scale 1 in 1x128
    blocks too. CPU `_scaled_mm` has no block scales: there the same operands are dequantized and
    multiplied in fp32 (what the GPU test compares cuBLAS with)."""
    n, k = weight.data.shape
    dq, sd = quantize_blocks(dy, col_scale=weight.scale.reshape(-1))
    if not dy.is_cuda:
        blockwise = sd.repeat_interleave(BLOCK, dim=1)
        return ((dq.float() * blockwise) @ weight.data.float()).to(torch.bfloat16)
    ones = torch.ones(n // BLOCK, k, dtype=torch.float32, device=dy.device)
    return torch._scaled_mm(dq, weight.input_gradient_layout().t(), scale_a=sd, scale_b=ones,
                            out_dtype=torch.bfloat16)


# how `dy·W` runs: on FP8 with dy quantized per token ("fp8") or per 1x128 block ("fp8-1x128"), or in
# bf16 on the dequantized weight ("bf16")
INPUT_GRADIENTS = ("fp8", "fp8-1x128", "bf16")


def compute_input_gradient(dy: torch.Tensor, weight: Fp8Weight, how: str) -> torch.Tensor:
    """`dy·W` of a 2D `[M, N]` output gradient the way `how` (one of `INPUT_GRADIENTS`) says, bf16 `[M, K]`."""
    if how == "bf16":  # only the weight's own rounding: dy stays as it is
        w = weight.data.to(torch.bfloat16) * weight.scale.reshape(-1, 1).to(torch.bfloat16)
        return dy.to(torch.bfloat16) @ w
    gemm = block_scaled_input_gradient_gemm if how == "fp8-1x128" else input_gradient_gemm
    return gemm(dy, weight)[: dy.shape[0]]


class _FrozenFp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None, cache: InputCache | None,
                input_gradient: str):
        rows = x.numel() // x.shape[-1]
        rows_out = aligned(rows)
        if cache is not None:
            xq, sx = cache.get(x, rows_out)
        else:
            xq, sx = quantize_rows(x.reshape(rows, x.shape[-1]), rows_out=rows_out)
        y = forward_gemm(xq, sx, weight)[:rows]
        y = y.to(x.dtype).reshape(*x.shape[:-1], y.shape[-1])
        if bias is not None:
            y = y + bias.to(y.dtype)
        ctx.weight = weight
        ctx.shape = x.shape
        ctx.dtype = x.dtype
        ctx.input_gradient = input_gradient
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None
        rows = dy.numel() // dy.shape[-1]
        dx = compute_input_gradient(dy.reshape(rows, dy.shape[-1]), ctx.weight, ctx.input_gradient)
        return dx.to(ctx.dtype).reshape(ctx.shape), None, None, None, None


def fp8_linear(x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None = None,
               cache: InputCache | None = None, input_gradient: str = "fp8") -> torch.Tensor:
    """`x·Wᵀ (+ bias)` with `W` frozen and FP8: autograd gives `x` its gradient, `W` and `bias` none.
    `input_gradient="bf16"` runs `dy·W` in bf16 on the dequantized weight (no quantized gradient; 1.17x
    the plugin in bf16 against 1.36x, 27B at 64 layers, H100); `"fp8-1x128"` quantizes dy per 1x128
    block instead of per token."""
    if input_gradient not in INPUT_GRADIENTS:
        raise ValueError(f"input_gradient={input_gradient!r}: one of {INPUT_GRADIENTS}")
    return _FrozenFp8Linear.apply(x, weight, bias, cache, input_gradient)


def bf16_linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """What FP8 replaces, in fp32: the oracle of the self-check and the tests."""
    y = x.float() @ weight.float().t()
    return y + bias.float() if bias is not None else y
