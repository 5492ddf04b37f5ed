"""Every chosen GPU kernel proven on this GPU, at the model's head shapes, before its first use.

On the first forward on a GPU each chosen kernel runs forward and backward on a small packed input
(the op's own `check_inputs`, ops/<op>.py) and is compared with the op's fp32 reference. A kernel
that raises or disagrees is replaced by the next one, and the report says why.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from .. import registry
from ..boundaries import Boundaries
from ..ops import SPECS, availability
from ..ops.backend import CheckShapes
from . import hopper_guard
from .selection import KernelChoice, KernelSet, enforce_mode, reference_backend

LOG = logging.getLogger("axolotl_fastqwen")

# bf16 carries 8 mantissa bits (eps 7.8e-3); fla's GDN forward and backward land at ~5e-3 against
# the fp32 reference (measured on an H200, head dim 128). A miscompiled kernel is off by O(1).
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 1e-2, torch.float32: 2e-3}


def check_boundaries(device) -> Boundaries:
    cu = torch.tensor([0, 100, 101, 288, 320])  # includes a 1-token sequence and an unaligned tail
    return Boundaries.from_cu_seqlens(cu.to(device), device=device, host=cu, source="self-check")


def check_inputs(op: str, shapes: CheckShapes, device, tokens: int = 320) -> tuple[list[torch.Tensor], dict]:
    """Random inputs of `op` at the model's head shapes (the self-check's, and the GPU tests')."""
    return SPECS[op].check_inputs(shapes, device, tokens)


def bind(op: str, fn: Callable, boundaries: Boundaries, extra: dict) -> Callable:
    """`fn` as a function of the tensors of `check_inputs` alone."""
    return SPECS[op].bind(fn, boundaries, extra)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    if not torch.isfinite(a).all():
        return float("inf")
    return float((a - b).norm() / b.norm().clamp(min=1e-12))


def compare(fast: Callable, ref: Callable, inputs: list[torch.Tensor], dtype: torch.dtype) -> float:
    """Max relative error of outputs and input gradients, `fast` at `dtype` vs `ref` in fp32.

    Runs with autograd on and autocast off whatever the caller's context (the first forward may
    be an evaluation under `no_grad`, or under autocast)."""
    with torch.enable_grad(), torch.autocast(inputs[0].device.type, enabled=False):
        gen = torch.Generator(device=inputs[0].device).manual_seed(7)
        results = []
        for fn, cast in ((fast, dtype), (ref, torch.float32)):
            xs = [x.detach().to(cast if x.is_floating_point() else x.dtype).requires_grad_(x.is_floating_point())
                  for x in inputs]
            results.append((fn(*xs), xs))
        grad_out = torch.randn(results[1][0].shape, generator=gen, device=inputs[0].device)
        grads = []
        for out, xs in results:
            (out.float() * grad_out).sum().backward()
            grads.append([x.grad for x in xs if x.requires_grad])
        errs = [rel_err(results[0][0], results[1][0])]
        errs += [rel_err(g_fast, g_ref) for g_fast, g_ref in zip(*grads)]
    return max(errs)


def selfcheck(kernels: KernelSet, shapes: CheckShapes, backends=None) -> None:
    """Prove each chosen GPU kernel on this GPU; demote any that fails. Idempotent."""
    if kernels.checked:
        return
    if backends is None:
        backends = registry.kernel_backends()
    device = kernels.device
    boundaries = check_boundaries(device)
    tol = TOLERANCE.get(shapes.dtype, 2e-2)
    for op, choice in kernels.choices.items():
        reference = reference_backend(backends, op)
        if choice.backend.fallback or choice.backend.name == reference.name:
            continue
        # then every other backend that can run here, fastest first (a preferred backend may rank
        # below the default one: that one is still the next to try)
        candidates = [choice.backend] + sorted(
            (b for b in backends if b.op == op and b.name != choice.backend.name and b.available(device) is None),
            key=lambda b: -b.priority,
        )
        for backend in candidates:
            if backend.fallback or backend.name == reference.name:
                kernels.choices[op] = KernelChoice(backend, choice.rejected, "reference (no kernel passed)")
                break
            passed, message = _check_one(op, backend, reference, shapes, boundaries, tol, kernels)
            if passed:
                kernels.choices[op] = KernelChoice(backend, choice.rejected, message)
                break
            choice.rejected.append((backend.name, f"self-check: {message}"))
            LOG.warning("axolotl_fastqwen: self-check rejected %s/%s: %s", op, backend.name, message)
    kernels.checked = True
    enforce_mode(kernels)


def _check_one(op, backend, reference, shapes, boundaries, tol, kernels) -> tuple[bool, str]:
    """(passed, summary) of `backend` against the fp32 reference at the model's shapes."""
    inputs, extra = check_inputs(op, shapes, kernels.device)
    fast, ref = bind(op, backend.fn, boundaries, extra), bind(op, reference.fn, boundaries, extra)
    lifted = False
    try:
        try:
            err = compare(fast, ref, inputs, shapes.dtype)
        except RuntimeError as exc:
            if backend.library == "fla" and "#640" in str(exc) and hopper_guard.active():
                # Whether *these* shapes are affected by fla#640 is decided here: the kernel runs with
                # the guard lifted and is compared with the reference (hopper_guard.py).
                hopper_guard.lift(kernels)
                lifted = True
                err = compare(fast, ref, inputs, shapes.dtype)
            else:
                raise
    except Exception as exc:  # a kernel that crashes is rejected, never trusted
        if lifted:
            hopper_guard.release(kernels)
        return False, f"raised {type(exc).__name__}: {str(exc)[:200]}"
    if not err <= tol:
        if lifted:
            hopper_guard.release(kernels)
        return False, f"rel. error {err:.2e} > {tol:.0e} vs fp32 reference"
    note = f"fwd+bwd rel. error {err:.1e} <= {tol:.0e}"
    if lifted:
        note += " (fla Hopper guard lifted)"
        lo, hi = hopper_guard.TRITON_AFFECTED
        kernels.notes.append(
            f"fla's Hopper guard (Triton >={lo},<{hi}, fla#640) lifted: its gated GDN backward passed the "
            f"self-check at K={shapes.key_dim}, V={shapes.value_dim}; restored by unpatch_model"
        )
        LOG.warning(
            "axolotl_fastqwen: fla refuses its gated GDN backward on Hopper with Triton %s (fla#640, a "
            "miscompile at block width 64). The self-check ran it at this model's head dims "
            "(K=%d, V=%d) against the fp32 reference: %s. Using it.",
            availability.version_of("triton"), shapes.key_dim, shapes.value_dim, note,
        )
    return True, note
