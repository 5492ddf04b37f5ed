"""Routed-expert stacks stored quantized behind a torch parametrization, as Axolotl's
`quantize_moe_experts` leaves them: bitsandbytes' `Bnb4bitParametrization` (with `load_in_4bit`, the
QLoRA examples of Qwen3.5-35B-A3B and Qwen3-Next-80B-A3B) or Axolotl's own `Bnb8bitParametrization`
(with `load_in_8bit`).

Reading `experts.gate_up_proj` then dequantizes the whole stack, so everything that only needs its
shape or dtype reads them here, from the quantization state, without dequantizing. And the grouped GEMM
of the routed rows with such a stack (`frozen_stack_grouped_mm`) dequantizes it in the forward and again
in the backward instead of letting autograd keep it: a GEMM saves its weight operand for the input's
gradient, so every layer between its forward and its backward (all of them where `auto` keeps a layer
unrecomputed) would hold its stacks in bf16, 1.5 GiB a layer on the 35B-A3B, the 4-bit storage's saving
undone. The second dequantization costs about as much as reading the bf16 stack once more. Axolotl's
ScatterMoE path for these stacks does the same (its `moe_bnb_fast`: "recomputed in backward, not saved").

Any other parametrization of a stack (another quantizer) is not read here: `stack_meta` returns None and
the experts keep transformers' implementation, which the report says. peft's own LoRA proxies, which
peft registers on top of a stack only while its `ParamWrapper` forward runs, keep the stack's shape and
dtype and make its value trainable: the stack is then read through its parametrizations, as peft means.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.utils import parametrize

# the dequantizing parametrizations this module knows: (module, class) -> what the report calls them
KNOWN = {("bitsandbytes.nn.parametrize", "Bnb4bitParametrization"): "bitsandbytes 4-bit",
         ("axolotl.monkeypatch.moe_quant", "Bnb8bitParametrization"): "bitsandbytes int8, row-wise scales"}
PEFT_PROXIES = ("_LoraParameterProxy", "_LoraFactorsProxy")  # peft.tuners.lora.layer: shape and dtype kept


@dataclass(frozen=True)
class StackMeta:
    """What a stack's value would be, read without computing it."""

    shape: torch.Size
    dtype: torch.dtype
    storage: torch.Tensor  # the Parameter that holds it: the stack itself, or its quantized original
    quantization: str | None  # e.g. "bitsandbytes 4-bit nf4"; None for a plain stack
    trainable_proxy: bool  # peft's LoRA proxy sits on top (its value requires grad)


def _known(p: nn.Module) -> str | None:
    return KNOWN.get((type(p).__module__, type(p).__qualname__))


def _peft_proxy(p: nn.Module) -> bool:
    return type(p).__module__.startswith("peft.") and type(p).__qualname__ in PEFT_PROXIES


def stack_meta(module: nn.Module, name: str) -> StackMeta | None:
    """The shape, dtype and storage of stack `name` of `module`; None where it is neither a plain tensor nor
    one known quantization (optionally under peft's LoRA proxies)."""
    if not parametrize.is_parametrized(module, name):
        value = getattr(module, name, None)
        if not isinstance(value, torch.Tensor):
            return None
        return StackMeta(value.shape, value.dtype, value, None, False)
    chain = module.parametrizations[name]
    original = chain.original
    first, rest = chain[0], list(chain)[1:]
    quantization = _known(first)
    if quantization is not None:
        state = getattr(first, "quant_state", None)
        if state is not None:  # 4-bit: a packed flat original; the state keeps the stack's shape and dtype
            shape, dtype = torch.Size(state.shape), state.dtype
            quantization = f"{quantization} {state.quant_type}"
        else:  # int8: the original has the stack's shape; bitsandbytes' `int8_vectorwise_dequant` returns float32
            shape, dtype = original.shape, torch.float32
        proxies = rest
    elif _peft_proxy(first):
        shape, dtype, proxies = original.shape, original.dtype, list(chain)
    else:
        return None
    if not all(_peft_proxy(p) for p in proxies):
        return None
    return StackMeta(shape, dtype, original, quantization, bool(proxies))


def describe_unreadable(module: nn.Module, name: str) -> str | None:
    """Why `stack_meta` is None for a parametrized stack (the parametrizations' classes), else None."""
    if not parametrize.is_parametrized(module, name) or stack_meta(module, name) is not None:
        return None
    classes = ", ".join(f"{type(p).__module__}.{type(p).__qualname__}" for p in module.parametrizations[name])
    return f"{name} is parametrized by {classes}, which the plugin does not read"


def frozen_quantized(module: nn.Module, name: str) -> str | None:
    """The quantization of a frozen quantized stack (nothing trainable on top), else None."""
    meta = stack_meta(module, name)
    return meta.quantization if meta is not None and not meta.trainable_proxy else None


def dequantized(module: nn.Module, name: str) -> torch.Tensor:
    """The stack's value, through its parametrization (within the experts module's own forward,
    bitsandbytes' hooks cache it there until the forward ends)."""
    with torch.no_grad():
        return getattr(module, name)


class _FrozenStackGroupedMM(torch.autograd.Function):
    """rows @ a frozen quantized stack, per expert: the stack dequantized in forward and again in backward,
    never saved; only the input's gradient (a quantized base has none)."""

    @staticmethod
    def forward(ctx, x, offsets, module, name, transposed, mm):
        ctx.save_for_backward(offsets)
        ctx.module, ctx.name, ctx.transposed, ctx.mm = module, name, transposed, mm
        weight = dequantized(module, name)
        return mm(x, weight if transposed else weight.transpose(-2, -1), offsets)

    @staticmethod
    def backward(ctx, grad):
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None, None
        (offsets,) = ctx.saved_tensors
        weight = dequantized(ctx.module, ctx.name)
        dx = ctx.mm(grad.to(weight.dtype), weight.transpose(-2, -1) if ctx.transposed else weight, offsets)
        return dx, None, None, None, None, None


def frozen_stack_grouped_mm(x: torch.Tensor, module: nn.Module, name: str, offsets: torch.Tensor, mm) -> torch.Tensor:
    """`x · W[e]ᵀ` for the rows of each expert e of the frozen quantized stack `name` (`module.is_transposed`
    layouts too), with `mm(rows, (E, in, out) weights, offsets)` the grouped GEMM."""
    return _FrozenStackGroupedMM.apply(x, offsets, module, name, bool(getattr(module, "is_transposed", False)), mm)
