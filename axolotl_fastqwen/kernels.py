"""Which implementation runs each op, decided once per model and proven on the GPU before use.

Selection: for every op, the highest-priority backend whose library is importable and whose
device is right; on the first forward on a GPU each chosen kernel is run forward and backward on
a small packed input of the model's real head shapes and compared with the fp32 reference. A
kernel that raises or disagrees is replaced by the next one, and the report says why. Nothing
falls back silently: `fastqwen_kernels: require` turns any fallback into an error, the default
warns once, loudly.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .boundaries import Boundaries
from .hookspecs import hookimpl
from .ops import availability
from .ops.causal_conv import causal_conv1d_cuda, fla_triton_causal_conv, reference_causal_conv
from .ops.gated_delta_rule import fla_gated_delta_rule, reference_gated_delta_rule
from .ops.gated_rmsnorm import fla_gated_rmsnorm, reference_gated_rmsnorm
from .ops.linear_cross_entropy import IGNORE_INDEX, liger_linear_cross_entropy, linear_cross_entropy
from .ops.varlen_attention import flash_attn_varlen, reference_varlen_attention, torch_varlen

LOG = logging.getLogger("axolotl_fastqwen")

OPS = ("gated_delta_rule", "causal_conv", "gated_rmsnorm", "varlen_attention", "linear_cross_entropy")
MODES = ("auto", "require", "reference")


class KernelUnavailableError(RuntimeError):
    """`fastqwen_kernels: require` and some op would run on the slow PyTorch path."""


@dataclass(frozen=True)
class KernelBackend:
    """One implementation of one op.

    `available(device)` returns None when the backend can run there, else the reason it cannot.
    `fallback` marks the slow PyTorch reference paths that `require` refuses.
    """

    op: str
    name: str
    fn: Callable
    priority: int
    available: Callable[[torch.device], str | None]
    library: str | None = None
    fallback: bool = False


def _always(device: torch.device) -> None:
    return None


def _on_cuda_with(check: Callable[[], bool], install_hint: str) -> Callable[[torch.device], str | None]:
    def available(device: torch.device) -> str | None:
        if device.type != "cuda":
            return f"needs a CUDA device (model is on {device.type})"
        if not check():
            return f"not installed ({install_hint})"
        return None

    return available


_FLA = _on_cuda_with(availability.has_fla, "pip install 'axolotl-fastqwen[kernels]'")
_CONV = _on_cuda_with(availability.has_causal_conv1d, "build causal-conv1d: README, 'Kernels on a GPU machine'")

BUILTIN_BACKENDS = (
    KernelBackend("gated_delta_rule", "fla", fla_gated_delta_rule, 100, _FLA, "fla"),
    KernelBackend("gated_delta_rule", "torch", reference_gated_delta_rule, 0, _always, fallback=True),
    KernelBackend("causal_conv", "causal-conv1d", causal_conv1d_cuda, 100, _CONV, "causal_conv1d"),
    KernelBackend("causal_conv", "fla-triton", fla_triton_causal_conv, 50, _FLA, "fla"),
    KernelBackend("causal_conv", "torch", reference_causal_conv, 0, _always, fallback=True),
    KernelBackend("gated_rmsnorm", "fla", fla_gated_rmsnorm, 100, _FLA, "fla"),
    KernelBackend("gated_rmsnorm", "torch", reference_gated_rmsnorm, 0, _always, fallback=True),
    KernelBackend(
        "varlen_attention", "flash-attn", flash_attn_varlen, 100,
        _on_cuda_with(availability.has_flash_attn, "pip install flash-attn"), "flash_attn",
    ),
    KernelBackend(
        "varlen_attention", "torch-varlen", torch_varlen, 50,
        _on_cuda_with(availability.has_torch_varlen, "needs torch>=2.10 with torch.nn.attention.varlen"),
    ),
    KernelBackend("varlen_attention", "torch", reference_varlen_attention, 0, _always, fallback=True),
    KernelBackend(
        "linear_cross_entropy", "liger", liger_linear_cross_entropy, 100,
        _on_cuda_with(availability.has_liger, "pip install liger-kernel"), "liger_kernel",
    ),
    # Chunked matmuls: cuBLAS does the work; the CPU path, and a sound GPU one (not a "fallback").
    KernelBackend("linear_cross_entropy", "torch-chunked", linear_cross_entropy, 0, _always),
)

# The fp32 oracle each op's kernels are checked against: its PyTorch fallback, except where named
# here (torch-chunked is exact in fp32 yet fast enough that `require` need not refuse it).
REFERENCE_BACKENDS = {"linear_cross_entropy": "torch-chunked"}


def reference_backend(backends, op: str) -> KernelBackend | None:
    """The backend of `op` that the self-check and the GPU tests treat as ground truth."""
    name = REFERENCE_BACKENDS.get(op)
    return next((b for b in backends if b.op == op and (b.name == name if name else b.fallback)), None)


@hookimpl
def fastqwen_kernel_backends():
    return list(BUILTIN_BACKENDS)


@dataclass
class KernelChoice:
    backend: KernelBackend
    rejected: list[tuple[str, str]] = field(default_factory=list)  # (backend name, why not)
    selfcheck: str | None = None


class KernelSet:
    """The chosen implementation of every op for one model. Layers hold a reference to it, so a
    self-check that demotes a kernel takes effect everywhere at once."""

    def __init__(self, choices: dict[str, KernelChoice], device: torch.device, mode: str):
        self.choices = choices
        self.device = device
        self.mode = mode
        self.checked = device.type != "cuda"  # only GPU kernels are self-checked
        self.notes: list[str] = []

    def __getattr__(self, op: str) -> Callable:
        choices = self.__dict__.get("choices", {})
        if op in choices:
            return choices[op].backend.fn
        raise AttributeError(op)

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
        from .registry import kernel_backends

        backends = kernel_backends()
    choices = {}
    for op in OPS:
        wanted = (prefer or {}).get(op)
        candidates = sorted((b for b in backends if b.op == op), key=lambda b: (b.name != wanted, -b.priority))
        if wanted and not any(b.name == wanted for b in candidates):
            raise ValueError(f"no backend {wanted!r} for {op}; known: {[b.name for b in candidates]}")
        rejected = []
        reference = reference_backend(candidates, op)
        for backend in candidates:
            if mode == "reference" and reference is not None and backend is not reference:
                rejected.append((backend.name, "fastqwen_kernels: reference"))
                continue
            reason = backend.available(device)
            if reason is None:
                choices[op] = KernelChoice(backend, rejected)
                break
            rejected.append((backend.name, reason))
        else:
            raise KernelUnavailableError(f"no backend can run {op} on {device}: {rejected}")
    kernels = KernelSet(choices, device, mode)
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
            "Install the kernels (pip install 'axolotl-fastqwen[kernels]', on a CUDA machine) or set "
            "fastqwen_kernels: auto."
        )
    if kernels.mode == "auto" and kernels.device.type == "cuda":
        LOG.warning(
            "axolotl_fastqwen: SLOW PATH: these ops run on the PyTorch reference, not a fused kernel: %s. "
            "Training is correct but much slower. Set fastqwen_kernels: require to make this an error.",
            detail,
        )


# --------------------------------------------------------------------------------------------
# Self-check on the GPU
# --------------------------------------------------------------------------------------------

# bf16 carries 8 mantissa bits (eps 7.8e-3); fla's GDN forward and backward land at ~5e-3 against
# the fp32 reference (measured on an H200, head dim 128). A miscompiled kernel is off by O(1).
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 1e-2, torch.float32: 2e-3}
# The loss is checked at a small hidden size and vocabulary (the real 248k-wide fp32 reference would
# take GBs), wider than Liger's 32,768-column block so that its loop over blocks and masked tail run.
CE_CHECK_HIDDEN, CE_CHECK_VOCAB = 256, 40_000


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


def check_boundaries(device) -> Boundaries:
    cu = torch.tensor([0, 100, 101, 288, 320])  # includes a 1-token sequence and an unaligned tail
    return Boundaries.from_cu_seqlens(cu.to(device), device=device, host=cu, source="self-check")


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    if not torch.isfinite(a).all():
        return float("inf")
    return float((a - b).norm() / b.norm().clamp(min=1e-12))


def compare(fast: Callable, ref: Callable, inputs: list[torch.Tensor], dtype: torch.dtype) -> float:
    """Max relative error of outputs and input gradients, `fast` at `dtype` vs `ref` in fp32.

    Runs with autograd on and autocast off whatever the caller's context (the first forward may
    be an evaluation under `no_grad`, or under autocast)."""
    with torch.enable_grad(), torch.autocast(inputs[0].device.type, enabled=False):
        return _compare_outputs_and_grads(fast, ref, inputs, dtype)


def _compare_outputs_and_grads(fast, ref, inputs, dtype) -> float:
    gen = torch.Generator(device=inputs[0].device).manual_seed(7)
    results = []
    for fn, cast in ((fast, dtype), (ref, torch.float32)):
        xs = [x.detach().to(cast if x.is_floating_point() else x.dtype).requires_grad_(x.is_floating_point()) for x in inputs]
        out = fn(*xs)
        results.append((out, xs))
    grad_out = torch.randn(results[1][0].shape, generator=gen, device=inputs[0].device)
    errs = []
    grads = []
    for out, xs in results:
        (out.float() * grad_out).sum().backward()
        grads.append([x.grad for x in xs if x.requires_grad])
    errs.append(_rel_err(results[0][0], results[1][0]))
    errs += [_rel_err(g_fast, g_ref) for g_fast, g_ref in zip(*grads)]
    return max(errs)


def check_inputs(op: str, shapes: CheckShapes, device, tokens: int = 320) -> tuple[list[torch.Tensor], dict]:
    """Random inputs of `op` at the model's head shapes for `tokens` packed tokens, plus the op's
    keyword arguments (the self-check's, and the GPU tests')."""
    gen = torch.Generator(device=device).manual_seed(0)
    T = tokens

    def rnd(*size, scale=1.0):
        return torch.randn(*size, generator=gen, device=device) * scale

    if op == "gated_delta_rule":
        Hk, Hv, K, V = shapes.key_heads, shapes.value_heads, shapes.key_dim, shapes.value_dim
        inputs = [rnd(1, T, Hk, K), rnd(1, T, Hk, K), rnd(1, T, Hv, V), rnd(1, T, Hv), rnd(1, T, Hv),
                  rnd(Hv, scale=0.5), rnd(Hv, scale=0.5)]
        return inputs, {}
    if op == "causal_conv":
        D = 2 * shapes.key_heads * shapes.key_dim + shapes.value_heads * shapes.value_dim
        return [rnd(1, T, D), rnd(D, shapes.conv_width, scale=0.5)], {"activation": "silu"}
    if op == "gated_rmsnorm":
        return [rnd(1, T, shapes.value_heads, shapes.value_dim), rnd(1, T, shapes.value_heads, shapes.value_dim),
                1 + rnd(shapes.value_dim, scale=0.1)], {"eps": 1e-6}
    if op == "varlen_attention":
        D = shapes.head_dim
        return [rnd(T, shapes.q_heads, D), rnd(T, shapes.kv_heads, D), rnd(T, shapes.kv_heads, D)], {"scale": D**-0.5}
    if op == "linear_cross_entropy":
        H, V = CE_CHECK_HIDDEN, CE_CHECK_VOCAB
        targets = torch.randint(0, V, (T,), generator=gen, device=device)
        targets[::5] = IGNORE_INDEX  # ignored tokens must get no loss and no gradient
        return [rnd(T, H), rnd(V, H, scale=2 * H**-0.5), targets], {}  # logits ~ N(0, 4)
    raise KeyError(op)


def bind(op: str, fn: Callable, boundaries: Boundaries, extra: dict) -> Callable:
    """`fn` as a function of the tensors of `check_inputs` alone."""
    if op == "gated_delta_rule":
        return lambda q, k, v, a, b, A_log, dt: fn(q, k, v, a, b, A_log, dt, boundaries=boundaries)
    if op == "causal_conv":
        return lambda x, w: fn(x, w, None, boundaries=boundaries, **extra)
    if op == "gated_rmsnorm":
        return lambda x, z, w: fn(x, z, w, **extra)
    if op == "varlen_attention":
        return lambda q, k, v: fn(q, k, v, boundaries=boundaries, **extra)
    if op == "linear_cross_entropy":
        return lambda hidden, weight, targets: fn(hidden, weight, targets, **extra)
    raise KeyError(op)


def selfcheck(kernels: KernelSet, shapes: CheckShapes, backends=None) -> None:
    """Prove each chosen GPU kernel on this GPU; demote any that fails. Idempotent."""
    if kernels.checked:
        return
    if backends is None:
        from .registry import kernel_backends

        backends = kernel_backends()
    device = kernels.device
    boundaries = check_boundaries(device)
    tol = TOLERANCE.get(shapes.dtype, 2e-2)
    for op, choice in kernels.choices.items():
        reference = reference_backend(backends, op)
        if choice.backend.fallback or (reference is not None and choice.backend.name == reference.name):
            continue
        if reference is None:
            choice.selfcheck = "not self-checked: no reference backend registered"
            continue
        candidates = [choice.backend] + sorted(
            (b for b in backends if b.op == op and b.priority < choice.backend.priority and b.available(device) is None),
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
            if backend.library == "fla" and "#640" in str(exc) and fla_hopper_guard_active():
                # fla refuses its gated backward on Hopper + Triton 3.4-3.7.0 because one block
                # width (64) miscompiles. Whether *these* shapes are affected is decided here, by
                # running the kernel with the guard lifted and comparing with the reference.
                set_fla_hopper_guard(False)
                lifted = True
                err = compare(fast, ref, inputs, shapes.dtype)
            else:
                raise
    except Exception as exc:  # a kernel that crashes is rejected, never trusted
        if lifted:
            set_fla_hopper_guard(True)
        return False, f"raised {type(exc).__name__}: {str(exc)[:200]}"
    if not err <= tol:
        if lifted:
            set_fla_hopper_guard(True)
        return False, f"rel. error {err:.2e} > {tol:.0e} vs fp32 reference"
    note = f"fwd+bwd rel. error {err:.1e} <= {tol:.0e}"
    if lifted:
        note += " (fla Hopper guard lifted)"
        kernels.notes.append(
            f"fla's Hopper guard (Triton >=3.4,<3.7.1, fla#640) lifted: its gated GDN backward passed the "
            f"self-check at K={shapes.key_dim}, V={shapes.value_dim}"
        )
        LOG.warning(
            "axolotl_fastqwen: fla refuses its gated GDN backward on Hopper with Triton %s (fla#640, a "
            "miscompile at block width 64). The self-check ran it at this model's head dims "
            "(K=%d, V=%d) against the fp32 reference: %s. Using it.",
            availability.version_of("triton"), shapes.key_dim, shapes.value_dim, note,
        )
    return True, note


def fla_hopper_guard_active() -> bool:
    with contextlib.suppress(Exception):
        import fla.ops.common.chunk_o as chunk_o

        return bool(chunk_o.IS_NVIDIA_HOPPER and chunk_o.TRITON_ABOVE_3_4_0 and not chunk_o.TRITON_ABOVE_3_7_1)
    return False


def set_fla_hopper_guard(enabled: bool) -> None:
    """fla checks a module global at call time; the only switch it offers is that global."""
    import fla.ops.common.chunk_o as chunk_o

    chunk_o.TRITON_ABOVE_3_7_1 = (not enabled) or _triton_at_least("3.7.1")


def _triton_at_least(v: str) -> bool:
    from packaging.version import Version

    return Version(availability.version_of("triton") or "0") >= Version(v)
