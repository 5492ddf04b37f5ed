"""Which frozen projections run in FP8: decided per weight shape, on this GPU, at the row's size.

FP8 pays only where the GEMM is large enough for the tensor cores' doubled peak to beat the cost
of quantizing the activation and the output gradient (torchao's H100 table: 0.80x at
1024x2048x1024, 1.39x at 4096x8192x16384). So each distinct `[N, K]` is timed here at the tokens
of one training row, forward and input gradient, quantization included, FP8 against bf16; FP8 is
taken only where it is at least `MIN_SPEEDUP` faster. Each shape is also self-checked first with
one of the model's own weights against the fp32 product: a kernel that raises or disagrees leaves
that shape in bf16, and the report says why. On a CPU nothing is timed (`torch._scaled_mm` runs
there, slowly: for tests) and every candidate takes FP8 once its self-check passes.

The routed experts' stacks `[E, N, K]` are decided the same way at their own shape: grouped GEMMs
over the row's `tokens × top-k` routed rows, spread evenly over the experts (`ops/fp8_grouped.py`).
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from ..ops import fp8_grouped
from ..ops.fp8_grouped import Fp8ExpertWeight, fp8_grouped_mm, grouped_reference
from ..ops.fp8_linear import Fp8Weight, bf16_linear_reference, compute_input_gradient, forward_gemm, fp8_linear
from ..ops.fp8_quantize import quantize_rows
from .selfcheck import rel_err

# e4m3 keeps 3 mantissa bits (relative rounding up to 2^-4 per element); with both operands rounded
# per row, a product of Gaussian operands lands at 3.7% relative to the fp32 product at every shape
# measured (tests/test_fp8_linear.py); a broken kernel or a wrong scale is off by O(1).
TOLERANCE = 0.06
MIN_SPEEDUP = 1.05  # below this the measurement's noise could decide
CHECK_TOKENS = 256


@dataclass
class ShapeDecision:
    out_features: int
    in_features: int
    fp8: bool
    why: str
    keep_transposed: bool = False  # the input gradient's layout: a kept copy, or transposed per backward
    bf16_ms: float | None = None  # forward + input gradient, one row
    fp8_ms: float | None = None  # the same in FP8 with that layout, quantization included
    error: float | None = None  # the self-check's relative error (the worse of output and input gradient)
    experts: int | None = None  # a routed experts' stack `[experts, out, in]`; None for a projection

    @property
    def speedup(self) -> float | None:
        return self.bf16_ms / self.fp8_ms if self.bf16_ms and self.fp8_ms else None

    def to_dict(self) -> dict:
        out = asdict(self)
        out["speedup"] = round(self.speedup, 3) if self.speedup else None
        return out


def self_check(weight: torch.Tensor, keep_transposed: bool, dtype: torch.dtype, input_gradient: str = "fp8") -> float:
    """Relative error of the FP8 forward and input gradient (computed as `input_gradient` says) against
    the fp32 product, on `weight`."""
    gen = torch.Generator(device=weight.device).manual_seed(11)
    x = torch.randn(CHECK_TOKENS, weight.shape[1], generator=gen, device=weight.device).to(dtype)
    dy = torch.randn(CHECK_TOKENS, weight.shape[0], generator=gen, device=weight.device).to(dtype)
    fp8 = Fp8Weight.quantize(weight, keep_transposed=keep_transposed)
    with torch.enable_grad(), torch.autocast(weight.device.type, enabled=False):
        xf = x.clone().requires_grad_(True)
        y = fp8_linear(xf, fp8, input_gradient=input_gradient)
        (dx,) = torch.autograd.grad(y, xf, dy)
    return max(rel_err(y, bf16_linear_reference(x, weight)), rel_err(dx, dy.float() @ weight.float()))


def _routed_offsets(rows: int, experts: int, device, gen: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(int32 offsets, each row's expert) of `rows` sorted routed rows: drawn at random when `gen` is
    given (experts without a row included), else spread evenly as a balanced router spreads them."""
    if gen is not None:
        groups = torch.randint(0, experts, (rows,), generator=gen, device=device).sort().values
    else:
        groups = torch.arange(rows, device=device) * experts // rows
    counts = torch.bincount(groups, minlength=experts)
    return torch.cumsum(counts, 0).to(torch.int32), groups


def self_check_experts(weight: torch.Tensor, keep_transposed: bool, dtype: torch.dtype,
                       input_gradient: str = "fp8") -> float:
    """`self_check` of an expert stack `[E, N, K]`: the FP8 grouped forward and input gradient against
    the fp32 products, rows routed at random (some experts get none)."""
    gen = torch.Generator(device=weight.device).manual_seed(11)
    offsets, groups = _routed_offsets(CHECK_TOKENS, weight.shape[0], weight.device, gen)
    x = torch.randn(CHECK_TOKENS, weight.shape[2], generator=gen, device=weight.device).to(dtype)
    dy = torch.randn(CHECK_TOKENS, weight.shape[1], generator=gen, device=weight.device).to(dtype)
    fp8 = Fp8ExpertWeight.quantize(weight, keep_transposed=keep_transposed)
    with torch.enable_grad(), torch.autocast(weight.device.type, enabled=False):
        xf = x.clone().requires_grad_(True)
        y = fp8_grouped_mm(xf, fp8, offsets, groups, input_gradient)
        (dx,) = torch.autograd.grad(y, xf, dy)
    exact_dx = grouped_reference(dy, weight.transpose(-2, -1), offsets)
    return max(rel_err(y, grouped_reference(x, weight, offsets)), rel_err(dx, exact_dx))


def time_experts(weight: torch.Tensor, rows: int, keep_transposed: bool, input_gradient: str = "fp8") -> tuple[float, float]:
    """(bf16 ms, FP8 ms) of the grouped forward + input gradient of `rows` routed rows through the stack."""
    experts, n, k = weight.shape
    gen = torch.Generator(device=weight.device).manual_seed(3)
    offsets, groups = _routed_offsets(rows, experts, weight.device)
    x = torch.randn(rows, k, generator=gen, device=weight.device, dtype=weight.dtype)
    dy = torch.randn(rows, n, generator=gen, device=weight.device, dtype=weight.dtype)
    fp8 = Fp8ExpertWeight.quantize(weight, keep_transposed=keep_transposed)

    def bf16():
        F.grouped_mm(x, weight.transpose(-2, -1), offs=offsets)
        F.grouped_mm(dy, weight, offs=offsets)

    def fp8_pair():  # what the op runs (ops/fp8_grouped.py)
        fp8_grouped.forward_gemm(x, fp8, offsets)
        fp8_grouped.input_gradient_gemm(dy, fp8, offsets, groups, input_gradient)

    with torch.no_grad():
        return median_ms(bf16), median_ms(fp8_pair)


def median_ms(fn, iters: int = 10, warmup: int = 3) -> float:
    """The median of `iters` CUDA-event timings of `fn` (ms), after `warmup` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def time_shape(weight: torch.Tensor, tokens: int, keep_transposed: bool,
               input_gradient: str = "fp8") -> tuple[float, float]:
    """(bf16 ms, FP8 ms) of one row's forward + input gradient through `weight`, on its GPU."""
    n, k = weight.shape
    gen = torch.Generator(device=weight.device).manual_seed(3)
    x = torch.randn(tokens, k, generator=gen, device=weight.device, dtype=weight.dtype)
    dy = torch.randn(tokens, n, generator=gen, device=weight.device, dtype=weight.dtype)
    fp8 = Fp8Weight.quantize(weight, keep_transposed=keep_transposed)

    def bf16():
        F.linear(x, weight)
        dy @ weight

    def fp8_pair():  # what the op runs (ops/fp8_linear.py), tokens a multiple of 16: no padding
        forward_gemm(*quantize_rows(x), fp8)
        compute_input_gradient(dy, fp8, input_gradient)

    with torch.no_grad():
        return median_ms(bf16), median_ms(fp8_pair)


def decide(samples: dict[tuple[int, ...], torch.Tensor], tokens: int, keep_transposed: bool = False,
           dtype: torch.dtype = torch.bfloat16, input_gradient: str = "fp8",
           rows_per_token: int = 1) -> dict[tuple[int, ...], ShapeDecision]:
    """One decision per `[N, K]` (a projection) or `[E, N, K]` (an expert stack, timed at
    `tokens × rows_per_token` routed rows), each from one weight of that shape (`samples`), with the
    input gradient's layout `keep_transposed`, computed as `input_gradient` says
    (ops/fp8_linear.INPUT_GRADIENTS; ops/fp8_grouped.INPUT_GRADIENTS for the stacks)."""
    out = {}
    for shape, weight in samples.items():
        stacked = len(shape) == 3
        *experts, n, k = shape
        decision = ShapeDecision(n, k, fp8=False, why="", keep_transposed=keep_transposed,
                                 experts=experts[0] if stacked else None)
        rows = tokens * rows_per_token if stacked else tokens
        try:
            check = self_check_experts if stacked else self_check
            decision.error = check(weight, keep_transposed, dtype, input_gradient)
        except Exception as exc:  # noqa: BLE001 - any failure keeps bf16, with the reason
            decision.why = f"self-check raised {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            out[shape] = decision
            continue
        if not decision.error <= TOLERANCE:
            decision.why = f"self-check failed: relative error {decision.error:.3g} > {TOLERANCE}"
        elif weight.device.type != "cuda":
            decision.fp8, decision.why = True, f"{weight.device.type}: not timed (FP8 speed exists on Hopper only)"
        else:
            timing = time_experts if stacked else time_shape
            decision.bf16_ms, decision.fp8_ms = timing(weight, rows, keep_transposed, input_gradient)
            decision.fp8 = decision.speedup >= MIN_SPEEDUP
            layout = "transposed copy kept" if decision.keep_transposed else "transposed per backward"
            what = f"{rows} routed rows, grouped" if stacked else f"{tokens} tokens"
            decision.why = (f"{decision.speedup:.2f}x bf16 at {what} (forward + input gradient, "
                            f"quantization included; {layout})"
                            + ("" if decision.fp8 else f"; FP8 needs {MIN_SPEEDUP}x"))
        out[shape] = decision
    return out
