"""What an op's implementations declare, so that selection and the self-check can treat them alike.

Each op module (`ops/<op>.py`) defines its implementations as `KernelBackend`s and its `OpSpec`:
the backend that is its fp32 reference, and the inputs the self-check runs it on at a model's
head shapes. Like fla 0.6's backend registry: one file per op holds its alternatives, and every
refusal comes with a reason: `available(device)` for the machine, `limits(*args)` for one call.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KernelBackend:
    """One implementation of one op.

    `available(device)` returns None when the backend can run there, else the reason it cannot.
    `limits(*args, **kwargs)`, if given, returns the reason a particular call is outside what the
    kernel does (fp32 inputs, attention dropout, ...); that call then runs on the op's reference,
    and the report names the reason (once). `fallback` marks the slow PyTorch reference paths that
    `fastqwen_kernels: require` refuses.
    """

    op: str
    name: str
    fn: Callable
    priority: int
    available: Callable[[torch.device], str | None]
    library: str | None = None
    fallback: bool = False
    limits: Callable[..., str | None] | None = None


@dataclass(frozen=True)
class CheckShapes:
    """Head shapes of the model being trained: kernels are checked at exactly these."""

    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    conv_width: int
    q_heads: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    hidden: int = 1024  # the residual stream's width (the RMSNorm check); callers pass the model's
    intermediate: int = 1024  # the dense MLP's (or the shared expert's) width (the SwiGLU check); likewise


# inputs: (tensors, keyword arguments) for `tokens` packed tokens; bind: fn -> a function of the tensors alone
CheckInputs = Callable[[CheckShapes, torch.device, int], tuple[list[torch.Tensor], dict]]
Bind = Callable[[Callable, object, dict], Callable]


@dataclass(frozen=True)
class OpSpec:
    """An op as the self-check sees it: its fp32 oracle and how to exercise it."""

    name: str
    reference: str  # the backend name that is ground truth (the self-check and GPU tests compare to it)
    check_inputs: CheckInputs
    bind: Bind


def always(device: torch.device) -> None:
    return None


def on_cuda_with(check: Callable[[], bool], install_hint: str) -> Callable[[torch.device], str | None]:
    """`available` for a CUDA kernel library: the device must be a GPU and the library import."""

    def available(device: torch.device) -> str | None:
        if device.type != "cuda":
            return f"needs a CUDA device (model is on {device.type})"
        if not check():
            return f"not installed ({install_hint})"
        return None

    return available


def generator(device, seed: int = 0) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def randn(gen: torch.Generator, device, *size, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*size, generator=gen, device=device) * scale
