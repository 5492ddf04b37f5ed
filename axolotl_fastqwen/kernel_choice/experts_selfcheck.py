"""The routed experts' implementation proven on this GPU, at the model's expert shapes.

transformers dispatches the experts by `config._experts_implementation` (its default on a GPU is
`grouped_mm`, which the plugin replaces by its `fastqwen_grouped`, `layers/grouped_experts.py`; Axolotl's
kernels plugin registers `scattermoe`; `experts_implementation.py` says who runs them). Like every kernel the plugin chooses,
the implementation that will train is run once before the first step, forward and backward, on the
first `CHECK_EXPERTS` experts of the model's first experts module (its own weights, its hidden and
intermediate sizes, its top-k) and compared with transformers' eager loop in fp32 (for
`fastqwen_grouped` with its factored LoRA as well, against the merged weights, and with a sparse
block's shared expert added in its sum). One that raises
or disagrees is replaced, through transformers' `set_experts_implementation`, by the next of
`FALLBACK_ORDER` that passes, and the report says why; the eager loop is the last resort. Where
`fastqwen_grouped` runs its routed rows in Triton kernels (`ops/routed_swiglu.py`, `ops/routed_combine.py`) and
fails, it is checked again on PyTorch's ops for its routed rows (pinned on every experts module if that
passes) before another implementation is tried.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn.utils import parametrize

from ..layers.experts_implementation import (EXPERT_WEIGHTS, experts_class, experts_implementation, experts_modules,
                                              set_experts_implementation)
from ..layers.grouped_experts import (ROUTED_KERNELS_ATTR, GROUPED, ExpertLora, SharedExpert, fp8_experts,
                                      grouped_experts_forward, register, routed_kernels)
from ..layers.quantized_stacks import dequantized, describe_unreadable, stack_meta
from .selfcheck import TOLERANCE, rel_err

LOG = logging.getLogger("axolotl_fastqwen")

CHECK_EXPERTS = 16  # experts of the check module (> top-k): every GEMM at its real (hidden, intermediate) shape
CHECK_RANK = 16  # the factored LoRA of fastqwen_grouped is checked at a typical adapter rank
LORA_SCALING = 2.0  # lora_alpha / r of the checked adapter
CHECK_TOKENS = 384  # uneven tokens per expert (random routing), some experts with none on small k
FALLBACK_ORDER = (GROUPED, "grouped_mm", "batched_mm", "eager")


class CheckSetupError(RuntimeError):
    """The check could not copy the experts module: says nothing about the implementation."""


@dataclass
class ExpertsCheck:
    """What the self-check decided: the implementation that trains, and why the others do not."""

    implementation: str | None
    selfcheck: str
    rejected: list[tuple[str, str]] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"implementation": self.implementation, "selfcheck": self.selfcheck,
                "rejected": [f"{name}: {why}" for name, why in self.rejected]}


def _stack_shape(module: nn.Module, name: str) -> torch.Size:
    meta = stack_meta(module, name)
    if meta is None:
        raise CheckSetupError(describe_unreadable(module, name) or f"no {name} tensor")
    return meta.shape


def _dispatched(module: nn.Module) -> bool:
    """A transformers experts class whose forward goes through its ExpertsInterface."""
    forward = type(module).forward
    return getattr(forward, "__wrapped__", None) is not None and hasattr(module, "config")


def check_module(module: nn.Module, implementation: str, dtype: torch.dtype, device: torch.device,
                 experts: int = CHECK_EXPERTS, kernels: str | None = None) -> nn.Module:
    """A module of `module`'s class holding copies of its first `experts` experts, in `dtype`, set
    to run `implementation` (its own config copy: the model's is not touched), with `fastqwen_grouped`'s
    routed-row kernels pinned to `kernels` where given. Stacks stored quantized (`quantized_stacks.py`) are
    copied as their dequantized values, as an FP8 stack is: the check is of the implementation at the
    model's shapes; the dequantizing GEMM's own math is held to the dequantized stack by the tests."""
    config = copy.copy(module.config)
    config.num_experts = experts
    config._experts_implementation = implementation
    with torch.device("meta"):
        proxy = experts_class(module)(config)
    proxy.config = config  # `use_experts_implementation` keeps the config it was built with
    if kernels is not None:
        proxy.__dict__[ROUTED_KERNELS_ATTR] = kernels
    weights = dict(module.named_parameters(recurse=False))
    weights.update({name: None for name in EXPERT_WEIGHTS if parametrize.is_parametrized(module, name)})
    for name, weight in weights.items():
        meta = stack_meta(module, name) if weight is None else None
        if weight is None and meta is None:
            raise CheckSetupError(describe_unreadable(module, name))
        storage = weight if weight is not None else meta.storage
        if type(storage).__name__ == "DTensor" or type(storage.data).__name__ == "DTensor":
            # FSDP2 shards: a copy would need a collective in the middle of the first forward
            raise CheckSetupError(f"{name} is sharded (DTensor)")
        if weight is None:
            weight = dequantized(module, name)
        fp8 = fp8_experts(module)
        stack = fp8.weight(module, name) if fp8 is not None else None
        if stack is not None:  # fastqwen_fp8's stack: its values (its own path is checked where it is decided)
            weight = type(stack)(stack.data[:experts], stack.scale[:experts]).dequantized(torch.float32)
        value = weight.detach()[:experts] if weight.dim() == 3 else weight.detach()
        setattr(proxy, name, nn.Parameter(value.to(device=device, dtype=dtype).clone()))
    for name, buffer in module.named_buffers(recurse=False):
        if fp8_experts(module) is None or "_fastqwen_fp8_" not in name:
            setattr(proxy, name, buffer.to(device))
    return proxy


def check_inputs(module: nn.Module, top_k: int, device: torch.device, tokens: int = CHECK_TOKENS,
                 experts: int = CHECK_EXPERTS) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Hidden states, top-k expert indices (distinct per token) and their routing weights."""
    gen = torch.Generator(device="cpu").manual_seed(11)
    hidden = torch.randn(tokens, _stack_shape(module, "gate_up_proj")[-1], generator=gen)
    k = min(top_k, experts)
    index = torch.rand(tokens, experts, generator=gen).argsort(dim=-1)[:, :k]
    weights = torch.randn(tokens, k, generator=gen).softmax(dim=-1)
    return hidden.to(device), index.to(device), weights.to(device)


class _AddLowRank(nn.Module):
    """The reference's LoRA: the stacked weight plus scaling * the product of the factors, in fp32."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor, scaling: float, transposed: bool):
        super().__init__()
        self.a, self.b, self.scaling, self.transposed = a, b, scaling, transposed

    def forward(self, weight):
        delta = self.scaling * (self.a @ self.b)  # (E, in, out)
        return weight + (delta if self.transposed else delta.transpose(-2, -1))


def _lora_factors(module: nn.Module, experts: int, rank: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Random (A: (E, in, r), B: (E, r, out)) per stacked weight, sized so that LORA_SCALING·(x·A)·B
    is ~0.3 x·W: an adapter well into training, not a zero-initialised one."""
    gen = torch.Generator(device="cpu").manual_seed(13)
    factors = {}
    for name in ("gate_up_proj", "down_proj"):
        weight = getattr(module, name)
        d_in, d_out = (weight.shape[1], weight.shape[2]) if module.is_transposed else (weight.shape[2], weight.shape[1])
        b_std = 0.3 / LORA_SCALING * float(weight.detach().float().std()) * (d_in / rank) ** 0.5
        factors[name] = (torch.randn(experts, d_in, rank, generator=gen) / d_in ** 0.5,
                         torch.randn(experts, rank, d_out, generator=gen) * b_std)
    return factors


def compare(module: nn.Module, implementation: str, top_k: int, dtype: torch.dtype, lora_rank: int = 0,
            kernels: str | None = None, shared: bool = False) -> float:
    """Max relative error of the output and of the gradients (hidden states, routing weights and
    expert weights) of `implementation` at `dtype` against the eager loop in fp32. With
    `lora_rank` (`fastqwen_grouped` only): both stacked weights frozen and adapted by random
    factors of that rank, run factored against the eager loop on the merged weights; the
    gradients compared are then the factors' instead of the weights'. With `shared`
    (`fastqwen_grouped` only): a random shared expert's output and gate logits are added in its sum,
    as a sparse block passes them (`layers/moe_block.py`), against the block's own
    `eager + sigmoid(gate)·shared` in fp32, their gradients compared too."""
    device = next(module.parameters()).device
    experts = min(CHECK_EXPERTS, _stack_shape(module, "gate_up_proj")[0])
    hidden, index, weights = check_inputs(module, top_k, device, experts=experts)
    gen = torch.Generator(device="cpu").manual_seed(17)
    shared_term = (torch.randn(hidden.shape, generator=gen).to(device),
                   (2 * torch.randn(hidden.shape[0], 1, generator=gen)).to(device)) if shared else None
    try:
        proxies = [(check_module(module, impl, cast, device, experts=experts, kernels=rows), cast)
                   for impl, cast, rows in ((implementation, dtype, kernels), ("eager", torch.float32, None))]
    except Exception as exc:
        raise CheckSetupError(f"{type(exc).__name__}: {str(exc)[:200]}") from exc
    factors = _lora_factors(module, experts, lora_rank) if lora_rank else {}
    runs = []
    with torch.enable_grad(), torch.autocast(device.type, enabled=False):
        for candidate, (proxy, cast) in zip((True, False), proxies):
            x = hidden.to(cast).requires_grad_(True)
            w = weights.to(cast).requires_grad_(True)
            term = [t.to(cast, copy=True).requires_grad_(True) for t in shared_term] if shared else []
            if shared:  # the reference is transformers' sparse block: the experts, then `+ sigmoid(gate)·shared`
                out = (grouped_experts_forward(proxy, x, index, w, shared_expert=SharedExpert(*term)) if candidate
                       else proxy(x, index, w) + torch.sigmoid(term[1]) * term[0])
                runs.append((out, [x, w, *term, *proxy.parameters()]))
                continue
            if not factors:
                runs.append((proxy(x, index, w), [x, w, *proxy.parameters()]))
                continue
            proxy.requires_grad_(False)
            # own copies per run: where `.to` is a no-op (fp32 on the factors' device) both runs would share
            # the leaves, and compare one gradient sum with itself
            leaves = {name: tuple(t.to(device, cast, copy=True).requires_grad_(True) for t in pair)
                      for name, pair in factors.items()}
            if candidate:
                lora = {name: ExpertLora(a, b, LORA_SCALING) for name, (a, b) in leaves.items()}
                out = grouped_experts_forward(proxy, x, index, w, lora=lora)
            else:
                for name, (a, b) in leaves.items():
                    parametrize.register_parametrization(
                        proxy, name, _AddLowRank(a, b, LORA_SCALING, proxy.is_transposed), unsafe=True)
                out = proxy(x, index, w)
            runs.append((out, [x, w, *(t for pair in leaves.values() for t in pair)]))
        grad = torch.randn(runs[1][0].shape, generator=torch.Generator(device="cpu").manual_seed(5)).to(device)
        for out, leaves in runs:
            (out.float() * grad).sum().backward()
        errors = [rel_err(runs[0][0], runs[1][0])]
        errors += [rel_err(a.grad, b.grad) if a.grad is not None else float("inf")  # a gradient it never computed
                   for a, b in zip(runs[0][1], runs[1][1]) if b.grad is not None]
    return max(errors)


def _refuse_fp8_stacks_without_grouped(module: nn.Module, rejected: list[tuple[str, str]]) -> None:
    """fastqwen_fp8's expert stacks run only in fastqwen_grouped: another implementation would read the
    e4m3 stacks as numbers. Stop with what failed instead of training on them."""
    if fp8_experts(module) is not None:
        why = "; ".join(f"{name}: {reason}" for name, reason in rejected)
        raise RuntimeError(f"axolotl_fastqwen: the routed experts' FP8 stacks need {GROUPED}, which failed its "
                           f"self-check on this GPU ({why}). Set fastqwen_fp8: false, or report the failure.")


def selfcheck_experts(model: nn.Module, dtype: torch.dtype,
                      devices: tuple[str, ...] = ("cuda",)) -> ExpertsCheck | None:
    """Check the experts implementation `model` will train with; demote it if it fails. None for a
    dense model; off the GPU nothing is checked, as for every other kernel (`devices`: the CPU
    tests run it there)."""
    found = experts_modules(model)
    if not found:
        return None
    register()  # a fallback candidate even where the plugin did not choose it
    module = found[0]
    device = next(module.parameters()).device
    implementation = experts_implementation(module)
    if device.type not in devices:
        return ExpertsCheck(implementation, f"not self-checked ({device.type})")
    if not _dispatched(module):
        return ExpertsCheck(implementation, f"not self-checked: {type(module).__qualname__} replaces the experts "
                                            "class (no eager loop to compare with)")
    if implementation in (None, "eager"):
        return ExpertsCheck("eager", "the reference itself (transformers' loop over the experts)")
    if stack_meta(module, "gate_up_proj") is None:
        return ExpertsCheck(implementation, f"not self-checked: {describe_unreadable(module, 'gate_up_proj')}")
    top_k = int(getattr(module.config, "num_experts_per_tok", 1))
    n_experts = min(CHECK_EXPERTS, _stack_shape(module, "gate_up_proj")[0])
    routed = min(top_k, n_experts)
    tol = TOLERANCE.get(dtype, 2e-2)
    rejected: list[tuple[str, str]] = []
    names = [implementation] + [name for name in FALLBACK_ORDER if name != implementation]
    candidates: list[tuple[str, str | None]] = []  # (implementation, fastqwen_grouped's routed-row kernels)
    for name in names:
        candidates.append((name, None))
        if name == GROUPED:
            candidates.append((name, "torch"))  # its Triton row kernels failing is no reason to leave it
    for name, kernels in candidates:
        if name == "eager":
            break
        if name == GROUPED:  # the check runs the row kernels the model's modules run now, then PyTorch's ops
            current = routed_kernels(module, stack_meta(module, "gate_up_proj").storage)
            if kernels == current:
                continue  # the first try already ran these
            kernels = kernels or current
        label = f"{name} (routed rows: {kernels})" if name == GROUPED else name
        try:
            # fastqwen_grouped with the shared expert's term its sparse blocks pass, and its factored LoRA
            # path too (it runs whenever peft adapts the experts)
            err = compare(module, name, top_k, dtype, kernels=kernels, shared=name == GROUPED)
            if name == GROUPED:
                err = max(err, compare(module, name, top_k, dtype, lora_rank=CHECK_RANK, kernels=kernels))
        except CheckSetupError as exc:  # the harness, not the implementation: keep it, say so
            return ExpertsCheck(implementation, f"not self-checked: the experts module could not be copied ({exc})",
                                rejected)
        except Exception as exc:  # an implementation that crashes is rejected, never trusted
            rejected.append((label, f"raised {type(exc).__name__}: {str(exc)[:200]}"))
            continue
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()
        if err <= tol:
            if name != implementation:
                _refuse_fp8_stacks_without_grouped(module, rejected)
                set_experts_implementation(model, name)
            if name == GROUPED and kernels != current:  # pinned where the model trains: every experts module
                for experts_module in found:
                    experts_module.__dict__[ROUTED_KERNELS_ATTR] = kernels
            return ExpertsCheck(name, f"fwd+bwd rel. error {err:.1e} <= {tol:.0e} vs eager fp32 ({n_experts} "
                                      f"experts, top-{routed}, {CHECK_TOKENS} tokens"
                                      f"{f', shared expert, factored LoRA r={CHECK_RANK}' if name == GROUPED else ''}"
                                      f"{f', routed rows: {kernels}' if name == GROUPED else ''})",
                                rejected)
        rejected.append((label, f"rel. error {err:.2e} > {tol:.0e} vs eager fp32"))
    for name, why in rejected:
        LOG.warning("axolotl_fastqwen: self-check rejected experts implementation %s: %s", name, why)
    _refuse_fp8_stacks_without_grouped(module, rejected)
    set_experts_implementation(model, "eager")
    return ExpertsCheck("eager", "every faster implementation failed the self-check: transformers' eager loop",
                        rejected)
