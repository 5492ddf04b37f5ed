"""The routed experts' forward the plugin registers in transformers' `ExpertsInterface` as
`fastqwen_grouped`: transformers' `grouped_mm` computation without what one GPU never needs, and
LoRA on the stacked expert weights kept factored.

Why not transformers' own `grouped_mm`: transformers 5.17 masks expert-parallel sentinel rows on
every call (three full-size `masked_fill` passes per layer each way: the largest kernel of the
35B-A3B profile, 22% of GPU kernel time, benchmarks/h200/2026-12-04c), and weights the top-k rows
on the hidden width after the down projection. And with peft's `target_parameters` LoRA on the
experts, peft merges `W + s·B·A` for the whole expert stack on every forward and backpropagates a
gradient the size of that stack. Here each routed row runs `x·Wₑᵀ + s·(x·Aₑᵀ)·Bₑᵀ` with grouped
GEMMs (the low-rank ones through the rank), the routing weight scales the intermediate row (4x
narrower than the hidden one; the down projection is linear, so the product is the same), with
SiLU in one Triton kernel each way on a GPU (`ops/routed_swiglu.py`), and the k rows of a token are
summed back into it in one Triton kernel on a GPU (`ops/routed_combine.py`; the down projection's
expert-LoRA rows, and the sparse block's gated shared expert where `layers/moe_block.py` passes it,
added in the same sum), else after one gather. Expert parallelism, biases and post-expert norms
are not handled here: such modules run transformers' `grouped_mm` unchanged. With `fastqwen_fp8`,
a frozen stack quantized by `patching/fp8_weights.py` runs its grouped GEMMs on FP8
(`ops/fp8_grouped.py`); the module says so in its `Fp8Experts`. Stacks that Axolotl's
`quantize_moe_experts` stored in 4 or 8 bits are dequantized for each grouped GEMM, forward and backward,
and never kept (`quantized_stacks.py`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..ops import availability
from ..ops.fp8_grouped import Fp8ExpertWeight, fp8_grouped_mm
from ..ops.routed_combine import (routed_combine_torch, routed_combine_triton, shared_term_backward_torch,
                                  shared_term_backward_triton)
from ..ops.routed_swiglu import routed_swiglu_triton
from .experts_implementation import EXPERT_WEIGHTS, experts_class, experts_implementation
from .forward_slot import bound_forward
from .mlp import runs_silu
from .quantized_stacks import describe_unreadable, frozen_quantized, frozen_stack_grouped_mm, stack_meta

GROUPED = "fastqwen_grouped"  # the name in transformers' ExpertsInterface
REPLACES = "grouped_mm"  # the implementation it stands in for (same math)
RANK_MULTIPLE = 8  # grouped GEMM operands need 16-byte rows: a bf16 rank is padded (with zeros) to a multiple of 8


@dataclass(frozen=True)
class ExpertLora:
    """One LoRA adapter on one stacked expert weight, factored: Δₑ = scaling · Bₑ·Aₑ.

    a: (experts, in, rank), b: (experts, rank, out), both in the weight's dtype; `x·a[e]` then
    `·b[e]` is the adapter's contribution for rows routed to expert e."""

    a: torch.Tensor
    b: torch.Tensor
    scaling: float


@dataclass(frozen=True)
class SharedExpert:
    """The shared expert's term of a sparse MoE block (Qwen3.5-MoE, Qwen3-Next): `sigmoid(gate)·output`,
    added to every token's routed sum. output: (T, H), the shared expert's MLP; gate: (T, 1), the logits of
    the block's `shared_expert_gate`. `fastqwen_grouped` adds it inside the sum of each token's routed rows
    (`ops/routed_combine.py`), instead of a multiply and an add over `[T, H]` each way."""

    output: torch.Tensor
    gate: torch.Tensor


@dataclass(frozen=True)
class Fp8Experts:
    """Which stacks of one experts module are FP8 (`patching/fp8_weights.py` sets it as the module's
    `FP8_ATTR`): each such stack's Parameter holds the e4m3 data `[E, N, K]`, with its scales (and a
    kept transposed copy) in the module's buffers `fp8_buffers(name)`, so that they move with the
    module. `dtype` is the stacks' dtype before: what the rows and the expert LoRA compute in."""

    names: tuple[str, ...]
    dtype: torch.dtype
    input_gradient: str = "fp8"

    def weight(self, module: nn.Module, name: str) -> Fp8ExpertWeight | None:
        if name not in self.names:
            return None
        data = getattr(module, name)
        if data.dtype != torch.float8_e4m3fn:
            raise RuntimeError(
                f"fastqwen_fp8: {type(module).__qualname__}.{name}'s e4m3 stack was cast to {data.dtype} after it "
                "was quantized, which turns it into meaningless values. Cast the model before the plugin patches "
                "it, or call unpatch_model(model) first.")
        scale, transposed = fp8_buffers(name)
        return Fp8ExpertWeight(data, module._buffers[scale], module._buffers.get(transposed))


FP8_ATTR = "_fastqwen_fp8_experts"


def fp8_buffers(name: str) -> tuple[str, str]:
    """The buffers of stack `name`'s FP8 scales and of its kept transposed copy."""
    return f"{name}_fastqwen_fp8_scale", f"{name}_fastqwen_fp8_transposed"


def fp8_experts(module: nn.Module) -> Fp8Experts | None:
    return module.__dict__.get(FP8_ATTR)


def compute_dtype(module: nn.Module) -> torch.dtype:
    """The dtype the routed rows and the expert LoRA run in: the stacks' own, or theirs before FP8."""
    fp8 = fp8_experts(module)
    return fp8.dtype if fp8 is not None else stack_meta(module, "gate_up_proj").dtype


# "torch" where the experts self-check pinned a module's routed rows off the Triton kernels
ROUTED_KERNELS_ATTR = "_fastqwen_routed_kernels"


def silu_gate(module: nn.Module) -> bool:
    """transformers' own gate on a concatenated `[gate | up]` with SiLU (Qwen3.5-MoE, Qwen3-Next): the
    computation `ops/routed_swiglu.py` fuses. Any other gate or layout keeps the module's `_apply_gate`."""
    gate = getattr(type(module), "_apply_gate", None)
    return (getattr(gate, "__name__", None) == "_default_apply_gate"
            and getattr(gate, "__module__", "").startswith("transformers.")
            and getattr(module, "is_concatenated", True)
            and runs_silu(module))


def routed_kernels(module: nn.Module, rows: torch.Tensor) -> str:
    """Who runs the module's row work on `rows`, "triton" or "torch" (the gate with its routing weight,
    where `silu_gate`, and the sums of each token's k rows, forward and in the input's gradient): the
    Triton kernels on a GPU, unless the experts self-check pinned "torch" (`kernel_choice/experts_selfcheck.py`);
    PyTorch's ops elsewhere and under torch.compile (which fuses them itself)."""
    if (not rows.is_cuda or torch.compiler.is_compiling() or module.__dict__.get(ROUTED_KERNELS_ATTR) == "torch"
            or not availability.importable("triton")):
        return "torch"
    return "triton"


def describe_routed_kernels(module: nn.Module) -> str:
    """The report's line on who runs `fastqwen_grouped`'s row work (gate, routing weight, combine), and why."""
    ops = "PyTorch's ops: the module's own _apply_gate, a multiply, a gather and a sum"
    if module.__dict__.get(ROUTED_KERNELS_ATTR) == "torch":
        return (f"{ops} (pinned: the experts self-check pins them where the Triton kernels fail it; its line says "
                "whether they did)")
    storage = stack_meta(module, "gate_up_proj").storage
    if routed_kernels(module, storage) == "torch":
        device = storage.device.type
        return f"{ops} ({f'on {device}' if device != 'cuda' else 'Triton does not import'})"
    gate = ("silu(gate)·up·w in one kernel each way (ops/routed_swiglu.py)" if silu_gate(module) else
            f"the module's own _apply_gate and a multiply ({experts_class(module).__qualname__} has another gate)")
    return f"triton: {gate}; each token's k rows summed in one kernel (ops/routed_combine.py)"


def unsupported(module: nn.Module) -> str | None:
    """Why the computation below is not exactly the module's own, or None: it needs a gated, bias-free
    experts module holding all its experts (no expert parallelism: transformers 5.20 says so in
    `_is_expert_parallel`, 5.17 has no flag, so the weights must hold every expert and not be sharded),
    with stacks it can read (plain, or quantized as `quantized_stacks.py` knows). Reads no stack's value."""
    metas = {}
    for name in EXPERT_WEIGHTS:
        metas[name] = stack_meta(module, name)
        if metas[name] is None:
            return describe_unreadable(module, name) or f"no {name} tensor"
    if any("DTensor" in (type(m.storage).__name__, type(m.storage.data).__name__) for m in metas.values()):
        return "its stacks are sharded (DTensor)"
    if (not getattr(module, "has_gate", False) or getattr(module, "has_bias", True)
            or getattr(module, "has_post_expert_norm", False)):
        return "not a gated, bias-free experts module without a post-expert norm"
    if getattr(module, "_is_expert_parallel", False):
        return "expert parallelism"
    if not metas["gate_up_proj"].shape[0] == metas["down_proj"].shape[0] == getattr(module, "num_experts", -1):
        return "its stacks do not hold every expert"
    return None


def supports(module: nn.Module) -> bool:
    return unsupported(module) is None


def _fused_grouped_mm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    if not hasattr(F, "grouped_mm"):
        return False
    if torch.compiler.is_compiling() and weight.dtype != torch.bfloat16:
        return False  # its fake kernel refuses other dtypes: torch.compile cannot trace it (fp32 on a CPU)
    if x.device.type == "cuda":  # the CUTLASS kernel: bf16 on sm80+
        return weight.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (8, 0)
    return x.device.type == "cpu"


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """(S, in) rows sorted by expert @ weight (E, in, out), rows offsets[e-1]:offsets[e] with
    expert e -> (S, out). torch's grouped GEMM where it runs; else one matmul per expert, through
    transformers' own custom op for that (`transformers::grouped_mm_fallback`, opaque to
    torch.compile, with its backward) where it is registered."""
    if _fused_grouped_mm(x, weight):
        return F.grouped_mm(x, weight, offs=offsets)
    fallback = getattr(getattr(torch.ops, "transformers", None), "grouped_mm_fallback", None)
    if fallback is not None:
        return fallback(x, weight, offsets)
    ends = offsets.tolist()
    starts = [0, *ends[:-1]]
    return torch.cat([x[s:e] @ weight[i] for i, (s, e) in enumerate(zip(starts, ends))])


def _project(x: torch.Tensor, module: nn.Module, name: str, offsets: torch.Tensor, groups: torch.Tensor,
             lora: ExpertLora | None) -> torch.Tensor:
    """`x · W[e]ᵀ` of each row with its expert's stack `name`, plus the factored LoRA of that stack."""
    fp8 = fp8_experts(module)
    fp8_weight = fp8.weight(module, name) if fp8 is not None else None
    if fp8_weight is not None:
        out = fp8_grouped_mm(x, fp8_weight, offsets, groups, fp8.input_gradient)
    elif frozen_quantized(module, name) is not None:
        out = frozen_stack_grouped_mm(x, module, name, offsets, grouped_mm)
    else:
        weight = getattr(module, name)
        out = grouped_mm(x, weight if module.is_transposed else weight.transpose(-2, -1), offsets)
    if lora is not None:
        out = out + _low_rank(x, lora, offsets)
    return out


def _low_rank(x: torch.Tensor, lora: ExpertLora, offsets: torch.Tensor) -> torch.Tensor:
    low = grouped_mm(x, lora.a, offsets)
    if lora.scaling != 1:
        low = low * lora.scaling  # (S, rank): scaled where it is narrow (1: folded into B already)
    return grouped_mm(low, lora.b, offsets)


def grouped_experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                            top_k_weights: torch.Tensor, lora: dict[str, ExpertLora] | None = None,
                            shared_expert: SharedExpert | None = None) -> torch.Tensor:
    """transformers' experts contract: hidden (T, H), top-k indices and weights (T, k) -> (T, H).
    `lora` maps "gate_up_proj" / "down_proj" to its factored adapter (see `patching/expert_lora.py`);
    `shared_expert`, where the sparse block passes it (`layers/moe_block.py`), is added to each token's
    sum: the output is then the block's, `routed + sigmoid(gate)·shared`."""
    if not supports(self):
        if lora or shared_expert is not None:
            raise ValueError(f"{type(self).__qualname__}: factored expert LoRA and the shared expert's term need a "
                             "gated, bias-free, single-GPU experts module")
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

        return ALL_EXPERTS_FUNCTIONS[REPLACES](self, hidden_states, top_k_index, top_k_weights)
    lora = lora or {}
    tokens, k = top_k_index.shape
    weight_dtype = compute_dtype(self)
    expert_ids, order, offsets = sort_by_expert(top_k_index, self.num_experts)
    unsort = torch.empty_like(order)
    unsort[order] = _arange(order.numel(), order.device)
    token_of_row = order // k
    triton = routed_kernels(self, hidden_states) == "triton"
    rows, routing = _RoutedRows.apply(hidden_states, top_k_weights.reshape(-1), order, token_of_row, unsort, k, triton)
    gate_up = _project(rows.to(weight_dtype), self, "gate_up_proj", offsets, expert_ids, lora.get("gate_up_proj"))
    if triton and silu_gate(self):
        inner = routed_swiglu_triton(gate_up, routing)
    else:
        inner = self._apply_gate(gate_up)
        inner = inner * routing.unsqueeze(-1).to(inner.dtype)
    down_lora = lora.get("down_proj")
    out = _project(inner, self, "down_proj", offsets, expert_ids, None if triton else down_lora)
    extra = _low_rank(inner, down_lora, offsets) if triton and down_lora is not None else None  # added in the sum
    if shared_expert is None:
        return _CombinedRows.apply(out, extra, None, None, token_of_row, unsort, k, triton).to(hidden_states.dtype)
    shared, gate = shared_expert.output, shared_expert.gate
    dtype = torch.promote_types(hidden_states.dtype, shared.dtype)  # the block's `routed.to(hidden) + shared`
    return _CombinedRows.apply(out, extra, shared, gate, token_of_row, unsort, k, triton).to(dtype)


def sort_by_expert(top_k_index: torch.Tensor, num_experts: int):
    """(each row's expert id in sorted order, the stable order that sorts the rows by expert, the int32
    end offset of each expert's rows), on the device: no host sync.

    The ids are sorted as the narrowest integer that holds them: a radix sort makes one pass per key
    byte, so int64 ids cost eight passes where uint8 ones (256 experts) cost one (about ten launches a
    layer on the 35B-A3B, benchmarks/h100/2026-12-06h, against three). The offsets are a binary search
    of each expert's last row in the sorted ids (one launch, where a histogram, its zero-fill and a
    cumulative sum took three)."""
    key = torch.uint8 if num_experts <= 256 else torch.int16 if num_experts <= 2**15 else torch.int64
    expert_ids, order = torch.sort(top_k_index.reshape(-1).to(key), stable=True)
    offsets = torch.searchsorted(expert_ids, _arange(num_experts, expert_ids.device, key), right=True, out_int32=True)
    return expert_ids, order, offsets


def _arange(n: int, device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """`torch.arange(n)`, made once per size and device (the packed rows' shape is static): one launch
    a layer fewer. Read only: its users index with it or search for it. Traced afresh under torch.compile, and
    made afresh inside a CUDA graph capture (`patching/moe_cuda_graphs.py`)."""
    if torch.compiler.is_compiling() or (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        return torch.arange(n, device=device, dtype=dtype)  # a graph's own (a cached one made in a capture is unset)
    return _cached_arange(n, device, dtype)


@functools.lru_cache(maxsize=32)
def _cached_arange(n: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    with torch.inference_mode(False), torch.no_grad():  # a plain tensor, whatever mode the first call ran in
        return torch.arange(n, device=device, dtype=dtype)


def takes_shared_expert(experts: nn.Module) -> bool:
    """Whether `experts(x, index, weights, shared_expert=...)` reaches `grouped_experts_forward` now: a
    transformers experts class dispatching to `fastqwen_grouped` that it supports, or an instance forward
    that says so itself (`takes_shared_expert()`: the factored expert LoRA's, `patching/expert_lora.py`)."""
    forward = bound_forward(experts)
    if forward is not None:
        says = getattr(forward, "takes_shared_expert", None)
        return bool(says is not None and says())
    return (experts_class(experts).__module__.startswith("transformers.") and experts_implementation(experts) == GROUPED
            and supports(experts))


def _sum_per_token(rows: torch.Tensor, unsort: torch.Tensor, k: int, triton: bool,
                   extra: torch.Tensor | None = None, shared: torch.Tensor | None = None,
                   gate: torch.Tensor | None = None) -> torch.Tensor:
    """(T·k, H) expert-ordered rows (+ `extra`'s) -> (T, H): each token's k rows summed, accumulated in fp32
    (+ `sigmoid(gate)·shared`, in the same sum)."""
    return (routed_combine_triton if triton else routed_combine_torch)(rows, unsort, k, extra, shared, gate)


class _RoutedRows(torch.autograd.Function):
    """(T, H) -> its (T·k, H) routed rows in expert order, `x[order // k]`, and the (T·k,) routing
    weights in the same order, `w[order]`. Autograd's backward of either index is a scatter-add that
    sorts its indices first (for the rows, in bf16: 51.7 ms a step, the second-largest elementwise
    kernel of the 35B-A3B profile in benchmarks/h200/2026-12-04d; for the weights, nine launches a
    layer). Both are permutations: each token's k rows are known, so the rows' gradient is each
    token's k rows summed back into it (`_sum_per_token`: one Triton kernel on a GPU, else a gather and
    a reduction, in fp32 and in a fixed order), and the weights' gradient is one gather by the inverse
    permutation."""

    @staticmethod
    def forward(ctx, x, weights, order, token_of_row, unsort, k, triton):
        ctx.save_for_backward(unsort)
        ctx.k, ctx.triton = k, triton
        return x[token_of_row], weights[order]

    @staticmethod
    def backward(ctx, grad_rows, grad_weights):
        (unsort,) = ctx.saved_tensors
        dx = _sum_per_token(grad_rows, unsort, ctx.k, ctx.triton) if ctx.needs_input_grad[0] else None
        dw = grad_weights[unsort] if ctx.needs_input_grad[1] else None
        return dx, dw, None, None, None, None, None


class _CombinedRows(torch.autograd.Function):
    """(T·k, H) expert-ordered rows (+ the down projection's expert-LoRA rows, `extra`, whose add is
    folded into the sum; + the shared expert's gated output) -> (T, H), each token's k rows summed:
    `_sum_per_token`. Its backward through the permutation is again a scatter; here it is the gather
    `grad[order // k]`, the same for both row inputs; the shared expert's and its gate's gradients come
    from one pass (`shared_term_backward_*`)."""

    @staticmethod
    def forward(ctx, y, extra, shared, gate, token_of_row, unsort, k, triton):
        ctx.save_for_backward(token_of_row, shared, gate)
        ctx.has_extra, ctx.triton = extra is not None, triton
        return _sum_per_token(y, unsort, k, triton, extra, shared, gate)

    @staticmethod
    def backward(ctx, grad):
        token_of_row, shared, gate = ctx.saved_tensors
        rows = grad[token_of_row]
        d_shared = d_gate = None
        if shared is not None:
            d_shared, d_gate = (shared_term_backward_triton if ctx.triton else shared_term_backward_torch)(
                grad, shared, gate)
        return rows, (rows if ctx.has_extra else None), d_shared, d_gate, None, None, None, None


def register() -> None:
    """Make `fastqwen_grouped` a valid `experts_implementation` (idempotent; a new key, no other
    entry of the interface changes)."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(GROUPED, grouped_experts_forward)
