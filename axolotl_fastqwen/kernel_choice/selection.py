"""Which implementation runs each op, decided once per model.

For every op, the highest-priority backend whose library imports and whose device is right (the
`available` check of `ops/backend.py`, with its reason for every refusal). Nothing falls back
silently: `fastqwen_kernels: require` turns any PyTorch fallback into an error, `auto` warns once,
loudly, and a call that a chosen kernel cannot take (its `limits`) runs on the op's reference with
the reason in the report.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .. import registry
from ..ops import OPS, SPECS, check_op_names
from ..ops.backend import KernelBackend

LOG = logging.getLogger("axolotl_fastqwen")

MODES = ("auto", "require", "reference")


class KernelUnavailableError(RuntimeError):
    """`fastqwen_kernels: require` and some op would run on the slow PyTorch path."""


def reference_backend(backends, op: str) -> KernelBackend | None:
    """The backend of `op` that the self-check and the GPU tests treat as ground truth."""
    name = SPECS[op].reference if op in SPECS else None
    return next((b for b in backends if b.op == op and b.name == name), None)


@dataclass
class KernelChoice:
    backend: KernelBackend
    rejected: list[tuple[str, str]] = field(default_factory=list)  # (backend name, why not)
    selfcheck: str | None = None


class KernelSet:
    """The chosen implementation of every op for one model. Layers hold a reference to it, so a
    self-check that demotes a kernel takes effect everywhere at once; `kernels.<op>(...)` calls it."""

    def __init__(self, choices: dict[str, KernelChoice], device: torch.device, mode: str,
                 references: dict[str, KernelBackend]):
        self.choices = choices
        self.device = device
        self.mode = mode
        self.references = references
        self.checked = device.type != "cuda"  # only GPU kernels are self-checked
        self.notes: list[str] = []
        self._calls: dict[tuple[str, str], Callable] = {}

    def __getattr__(self, op: str) -> Callable:
        choices = self.__dict__.get("choices", {})
        if op not in choices:
            raise AttributeError(op)
        backend = choices[op].backend
        key = (op, backend.name)
        if key not in self._calls:
            self._calls[key] = backend.fn if backend.limits is None else self._within_limits(op, backend)
        return self._calls[key]

    def _within_limits(self, op: str, backend: KernelBackend) -> Callable:
        reference = self.references[op]

        def call(*args, **kwargs):
            reason = backend.limits(*args, **kwargs)
            if reason is None:
                return backend.fn(*args, **kwargs)
            self.note(f"{op}: {backend.name} hands calls with {reason} to {reference.name}")
            return reference.fn(*args, **kwargs)

        return call

    def note(self, text: str) -> None:
        """A line for the report, once."""
        if text not in self.notes:
            self.notes.append(text)
            LOG.warning("axolotl_fastqwen: %s", text)

    def names(self) -> dict[str, str]:
        return {op: choice.backend.name for op, choice in self.choices.items()}

    def fallbacks(self) -> dict[str, KernelChoice]:
        return {op: c for op, c in self.choices.items() if c.backend.fallback}


def select_kernels(
    device: torch.device | str, mode: str = "auto", backends=None, prefer: dict[str, str] | None = None
) -> KernelSet:
    """Pick, for each op, the best backend that can run on `device`.

    `prefer` maps an op to a backend name to try first (benchmarks and tests of one backend).
    """
    if mode not in MODES:
        raise ValueError(f"fastqwen_kernels must be one of {MODES}, got {mode!r}")
    device = torch.device(device)
    if backends is None:
        backends = registry.kernel_backends()
    check_op_names(prefer or {}, "prefer")
    choices, references = {}, {}
    for op in OPS:
        wanted = (prefer or {}).get(op)
        candidates = sorted((b for b in backends if b.op == op), key=lambda b: (b.name != wanted, -b.priority))
        if wanted and not any(b.name == wanted for b in candidates):
            raise ValueError(f"no backend {wanted!r} for {op}; known: {[b.name for b in candidates]}")
        reference = reference_backend(candidates, op)
        if reference is None:
            raise KernelUnavailableError(f"{op} has no reference backend {SPECS[op].reference!r} registered")
        references[op] = reference
        rejected = []
        for backend in candidates:
            if mode == "reference" and backend is not reference:
                rejected.append((backend.name, "fastqwen_kernels: reference"))
                continue
            reason = backend.available(device)
            if reason is None:
                choices[op] = KernelChoice(backend, rejected)
                break
            rejected.append((backend.name, reason))
        else:
            raise KernelUnavailableError(f"no backend can run {op} on {device}: {rejected}")
    kernels = KernelSet(choices, device, mode, references)
    enforce_mode(kernels)
    return kernels


def enforce_mode(kernels: KernelSet) -> None:
    """`require`: refuse any slow fallback. `auto`: say so loudly (once per model) on a GPU."""
    fallbacks = kernels.fallbacks()
    if not fallbacks:
        return
    detail = "; ".join(
        f"{op} -> {c.backend.name} ({', '.join(f'{n}: {why}' for n, why in c.rejected) or 'no faster backend'})"
        for op, c in fallbacks.items()
    )
    if kernels.mode == "require":
        raise KernelUnavailableError(
            f"fastqwen_kernels: require, but these ops would run on the slow PyTorch path: {detail}. "
            "Install the kernels on a CUDA machine (the [kernels] extra: README, 'Install') or set "
            "fastqwen_kernels: auto."
        )
    if kernels.mode == "auto" and kernels.device.type == "cuda":
        LOG.warning(
            "axolotl_fastqwen: SLOW PATH: these ops run on the PyTorch reference, not a fused kernel: %s. "
            "Training is correct but much slower. Set fastqwen_kernels: require to make this an error.",
            detail,
        )
