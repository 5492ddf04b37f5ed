"""The routed experts' grouped GEMMs on FP8 for a frozen expert stack: the forward `x·Wₑᵀ` of each
row with its expert's weight, and the input gradient `dy·Wₑ`, never a weight gradient.

The same recipe as `ops/fp8_linear.py`, one expert per group of rows: the stack `[E, N, K]` is
quantized once (e4m3, a scale per expert and output channel), each step quantizes only the routed
rows and their output gradients per row, and both GEMMs are `torch._scaled_grouped_mm` with
row-wise scales (CUTLASS on Hopper) over the groups' row offsets, as `F.grouped_mm` runs them in
bf16. The input gradient contracts over the output channels, where the weight's scales live: each
row of `dy` takes its own expert's scales as it is quantized (`quantize_rows(..., groups=)`), and the
GEMM reads `W_q` as stored, transposed to `[E, K, N]` (kept, or made per backward by
`ops/fp8_transpose.py`). The rows are not padded: the groups' offsets cut them, and a grouped GEMM
takes any count per group, none included.

PyTorch has no CPU kernel for it; there the same quantized operands are dequantized and multiplied
in fp32, expert by expert (what the GPU test compares CUTLASS with).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .fp8_quantize import E4M3, E4M3_MAX, quantize_rows
from .fp8_transpose import transpose

# how `dy·Wₑ` runs: on FP8 with dy quantized per row ("fp8"), or in bf16 on the dequantized stack
# ("bf16"). torch has no grouped GEMM with 1x128 block scales on Hopper: "fp8-1x128" is the dense
# projections' choice only (patching/fp8_weights.py says what the experts run then).
INPUT_GRADIENTS = ("fp8", "bf16")
QUANTIZE_CHUNK = 1 << 26  # elements of a stack quantized at a time (256 MiB of fp32)


@dataclass
class Fp8ExpertWeight:
    """A frozen expert stack `[E, N, K]` (expert e computes `x·W[e]ᵀ`) as e4m3 `data` with a scale per
    expert and output channel (`scale`, `[E, N]` fp32): W[e] ≈ data[e] · scale[e] per row.
    `transposed` (`[E, K, N]`, e4m3) is the input gradient's layout when kept."""

    data: torch.Tensor
    scale: torch.Tensor
    transposed: torch.Tensor | None = None

    @classmethod
    def quantize(cls, weight: torch.Tensor, keep_transposed: bool = False) -> Fp8ExpertWeight:
        """Expert by expert in chunks of about `QUANTIZE_CHUNK` elements: the fp32 temporaries of a
        whole stack (35B-A3B's gate_up: 2.1 GiB each) would not fit beside the model on an 80 GB card."""
        w = weight.detach()
        experts, n, k = w.shape
        data = torch.empty(w.shape, dtype=E4M3, device=w.device)
        scale = torch.empty(experts, n, dtype=torch.float32, device=w.device)
        step = max(1, QUANTIZE_CHUNK // (n * k))
        for first in range(0, experts, step):
            part = w[first:first + step].float()
            amax = part.abs().amax(dim=2, keepdim=True)
            amax = torch.where(amax > 0, amax, torch.full_like(amax, E4M3_MAX))
            data[first:first + step] = (part * (E4M3_MAX / amax)).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
            scale[first:first + step] = (amax / E4M3_MAX).squeeze(2)
        out = cls(data=data, scale=scale)
        if keep_transposed:
            out.transposed = transpose(data)
        return out

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.data, self.scale, self.transposed) if t is not None)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return (self.data.to(torch.float32) * self.scale.unsqueeze(2)).to(dtype)

    def input_gradient_layout(self) -> torch.Tensor:
        """`W_q` as `[E, K, N]` row-major (so that `.transpose(-2, -1)` is the column-major `[E, N, K]` operand)."""
        return self.transposed if self.transposed is not None else transpose(self.data)


def _dequantized_grouped(aq: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor,
                         offsets: torch.Tensor) -> torch.Tensor:
    """The CPU stand-in: `(aq·sa)[rows of e] @ (b[e]·sb[e])` in fp32 per expert, b `[E, K, N]`, sb `[E, N]`."""
    a = aq.float() * sa.reshape(-1, 1)
    return grouped_reference(a, (b.float() * sb.unsqueeze(1)).transpose(-2, -1), offsets).to(torch.bfloat16)


def scaled_grouped_mm(aq: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor, offsets: torch.Tensor,
                      fast_accumulation: bool = False) -> torch.Tensor:
    """`aq [S, K]` (e4m3, row scales `sa` [S, 1]) times `b [E, K, N]` (e4m3, column-major in its last two
    dimensions, scales `sb` [E, N]) over row groups ending at `offsets` -> bf16 `[S, N]`."""
    if not aq.is_cuda:
        return _dequantized_grouped(aq, sa, b, sb, offsets)
    return torch._scaled_grouped_mm(aq, b, sa.reshape(-1), sb, offs=offsets, out_dtype=torch.bfloat16,
                                    use_fast_accum=fast_accumulation)


def forward_gemm(x: torch.Tensor, weight: Fp8ExpertWeight, offsets: torch.Tensor) -> torch.Tensor:
    """`x[rows of e] · W[e]ᵀ` for rows sorted by expert (bf16 `[S, N]`), fast accumulation as the dense forward."""
    xq, sx = quantize_rows(x, rows_out=x.shape[0])
    return scaled_grouped_mm(xq, sx, weight.data.transpose(-2, -1), weight.scale, offsets, fast_accumulation=True)


def input_gradient_gemm(dy: torch.Tensor, weight: Fp8ExpertWeight, offsets: torch.Tensor, groups: torch.Tensor,
                        how: str) -> torch.Tensor:
    """`dy[rows of e] · W[e]` (bf16 `[S, K]`): each row of dy quantized with its expert's scales folded
    in (`groups`: each row's expert), then the FP8 grouped GEMM on `W_q`; or in bf16 on the dequantized
    stack (`how="bf16"`)."""
    if how == "bf16":
        w = weight.dequantized(torch.bfloat16)  # [E, N, K]
        if dy.is_cuda:
            return torch.nn.functional.grouped_mm(dy.to(torch.bfloat16), w, offs=offsets)
        return grouped_reference(dy, w.transpose(-2, -1), offsets).to(torch.bfloat16)
    dq, sd = quantize_rows(dy, col_scale=weight.scale, groups=groups)
    ones = torch.ones(weight.data.shape[0], weight.data.shape[2], dtype=torch.float32, device=dy.device)
    return scaled_grouped_mm(dq, sd, weight.input_gradient_layout().transpose(-2, -1), ones, offsets)


class _FrozenFp8GroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight: Fp8ExpertWeight, offsets, groups, how: str):
        ctx.save_for_backward(offsets, groups)
        ctx.weight, ctx.how, ctx.dtype = weight, how, x.dtype
        return forward_gemm(x, weight, offsets).to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None
        offsets, groups = ctx.saved_tensors
        dx = input_gradient_gemm(dy.contiguous(), ctx.weight, offsets, groups, ctx.how)
        return dx.to(ctx.dtype), None, None, None, None


def fp8_grouped_mm(x: torch.Tensor, weight: Fp8ExpertWeight, offsets: torch.Tensor, groups: torch.Tensor,
                   input_gradient: str = "fp8") -> torch.Tensor:
    """Rows `x [S, K]` sorted by expert (`offsets`: int32 ends of each expert's rows; `groups`: each
    row's expert) times the frozen FP8 stack -> `[S, N]`; autograd gives `x` its gradient, the stack none."""
    if input_gradient not in INPUT_GRADIENTS:
        raise ValueError(f"input_gradient={input_gradient!r}: one of {INPUT_GRADIENTS}")
    return _FrozenFp8GroupedMM.apply(x, weight, offsets, groups, input_gradient)


def grouped_reference(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """What FP8 replaces, in fp32 (`weight` `[E, N, K]`): the oracle of the self-check and the tests."""
    out = torch.zeros(x.shape[0], weight.shape[1], dtype=torch.float32, device=x.device)
    start = 0
    for expert, end in enumerate(offsets.tolist()):
        out[start:end] = x[start:end].float() @ weight[expert].float().t()
        start = end
    return out
