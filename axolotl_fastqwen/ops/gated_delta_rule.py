"""The gated delta rule, the recurrence at the heart of every Gated DeltaNet layer.

Inputs are taken raw, as the layer produces them: q/k before their L2 norm (with the native,
smaller number of key heads), `a` before the decay gate and `b` before its sigmoid. The fla
backend then does the L2 norm, the gate `g = -exp(A_log) * softplus(a + dt_bias)`, the beta
sigmoid and the grouped-value-head broadcast inside its kernels; FlashQLA (opt-in) takes gate and
beta ready-made; the reference does the same steps in fp32 PyTorch, one sequence at a time, so
sequences can never leak into each other.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..hookspecs import hookimpl
from . import availability
from .backend import CheckShapes, KernelBackend, OpSpec, always, generator, on_cuda_with, randn


def fla_gated_delta_rule(q, k, v, a, b, A_log, dt_bias, *, boundaries):
    """fla's chunk kernel, with the L2 norm, decay gate, beta sigmoid and grouped value heads
    done in-kernel. q, k `[B, T, Hk, Dk]`; v `[B, T, Hv, Dv]`; a, b `[B, T, Hv]`; with
    `boundaries`, B == 1. Returns `[B, T, Hv, Dv]`."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    varlen = boundaries.fla_varlen() if boundaries is not None else {}
    out, _ = chunk_gated_delta_rule(
        q,
        k,
        v,
        g=a,
        beta=b,
        scale=q.shape[-1] ** -0.5,
        use_qk_l2norm_in_kernel=True,
        use_beta_sigmoid_in_kernel=True,
        use_gate_in_kernel=True,
        A_log=A_log,
        dt_bias=dt_bias,
        **varlen,
    )
    return out


def flashqla_gated_delta_rule(q, k, v, a, b, A_log, dt_bias, *, boundaries):
    """FlashQLA's fused TileLang kernels (QwenLM). They take the decay gate and beta ready-made
    (fla 0.6 does not route in-kernel gating to them), so those two run here as transformers
    computes them (gate in fp32, beta in the projection's dtype), their gradients through
    autograd; the L2 norm and the grouped value heads stay in-kernel. Same shapes as fla's."""
    from flash_qla import chunk_gated_delta_rule

    out, _ = chunk_gated_delta_rule(
        q,
        k,
        v,
        decay_gate(a, A_log, dt_bias),
        b.sigmoid(),
        scale=q.shape[-1] ** -0.5,
        use_qk_l2norm_in_kernel=True,
        cu_seqlens=boundaries.cu_seqlens_int64() if boundaries is not None else None,
    )
    return out


# FlashQLA 0.1.3 compiles its kernels for 16-bit q/k/v and head dim 128 only (fla 0.6's own
# verifier for it says the same).
FLASH_QLA_DTYPES = (torch.bfloat16, torch.float16)
FLASH_QLA_HEAD_DIM = 128


def flashqla_limits(q, k, v, *args, **kwargs) -> str | None:
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in FLASH_QLA_DTYPES:
        return f"{q.dtype}/{k.dtype}/{v.dtype} q/k/v (FlashQLA takes one 16-bit dtype)"
    if q.shape[-1] != FLASH_QLA_HEAD_DIM or v.shape[-1] != FLASH_QLA_HEAD_DIM:
        return f"head dims K={q.shape[-1]}, V={v.shape[-1]} (FlashQLA takes {FLASH_QLA_HEAD_DIM} only)"
    return None


def decay_gate(a: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """Log-space decay per token and value head, at least fp32: `-exp(A_log) * softplus(a + dt_bias)`.

    Same expression and casts as transformers' layer, so the torch path matches it bit for bit.
    """
    return -A_log.float().exp() * F.softplus(a.float() + dt_bias)


def reference_gated_delta_rule(q, k, v, a, b, A_log, dt_bias, *, boundaries=None, chunk_size=64):
    """fp32 PyTorch gated delta rule; the CPU path and the oracle of the kernel self-check."""
    out_dtype = v.dtype
    work = torch.float64 if torch.float64 in (q.dtype, v.dtype, A_log.dtype) else torch.float32
    g = decay_gate(a, A_log, dt_bias).to(work)
    beta = b.to(work).sigmoid()
    groups = v.shape[2] // q.shape[2]
    q = _l2norm(q.to(work))
    k = _l2norm(k.to(work))
    if groups > 1:  # broadcast each key head to its group of value heads (fla does this in-kernel)
        q = q.repeat_interleave(groups, dim=2)
        k = k.repeat_interleave(groups, dim=2)
    q = q * q.shape[-1] ** -0.5
    v = v.to(work)
    if boundaries is None:
        spans = [(row, 0, q.shape[1]) for row in range(q.shape[0])]
    else:
        cu = boundaries.cu_seqlens_host.tolist()
        spans = [(0, start, end) for start, end in zip(cu[:-1], cu[1:])]
    out = torch.empty_like(v)
    for row, start, end in spans:
        piece = slice(start, end)
        out[row, piece] = _chunked_rule(
            *(t[row, piece].transpose(0, 1) for t in (q, k, v, g, beta)), chunk_size
        ).transpose(0, 1)
    return out.to(out_dtype)


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    # Same form as fla's and transformers': x / sqrt(sum(x^2) + eps).
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _chunked_rule(q, k, v, g, beta, chunk_size):
    """One sequence, heads first: q/k `[H, T, K]`, v `[H, T, V]`, g/beta `[H, T]`, all fp32.

    The WY form of the delta rule: within a chunk the rank-one updates collapse into a
    unit-lower-triangular solve; across chunks one state `[H, K, V]` is carried.
    """
    H, T, K = k.shape
    C = chunk_size
    pad = (-T) % C
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = (F.pad(t, (0, pad)) for t in (g, beta))
    n = (T + pad) // C
    q, k, v = (t.reshape(H, n, C, -1) for t in (q, k, v))
    g, beta = g.reshape(H, n, C), beta.reshape(H, n, C)

    cum = g.cumsum(-1)  # log decay from chunk start to each position
    rel = cum.unsqueeze(-1) - cum.unsqueeze(-2)  # rel[..., i, j] = decay from j to i
    lower = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    rel_decay = rel.masked_fill(~lower, float("-inf")).exp()
    k_beta = k * beta.unsqueeze(-1)
    system = (k_beta @ k.transpose(-1, -2)) * rel_decay  # its unit diagonal is implied below
    u = torch.linalg.solve_triangular(system, v * beta.unsqueeze(-1), upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * cum.exp().unsqueeze(-1), upper=False, unitriangular=True)
    intra = (q @ k.transpose(-1, -2)) * rel_decay
    q_decayed = q * cum.exp().unsqueeze(-1)
    k_to_end = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    chunk_decay = cum[..., -1].exp()

    state = q.new_zeros(H, K, v.shape[-1])
    outs = []
    for i in range(n):
        v_new = u[:, i] - w[:, i] @ state
        outs.append(q_decayed[:, i] @ state + intra[:, i] @ v_new)
        state = state * chunk_decay[:, i, None, None] + k_to_end[:, i].transpose(-1, -2) @ v_new
    return torch.cat(outs, dim=1)[:, :T]


def naive_recurrence(q, k, v, a, b, A_log, dt_bias):
    """Token-by-token gated delta rule on one `[1, T, ...]` sequence: slow, obviously right.

    Used only by tests to pin the chunked reference to the definition:
    S_t = exp(g_t) S_{t-1} + beta_t k_t (v_t - exp(g_t) S_{t-1}^T k_t)^T,  o_t = S_t^T q_t.
    """
    g = decay_gate(a.double(), A_log.double(), dt_bias.double())[0]
    beta = b.double().sigmoid()[0]
    groups = v.shape[2] // q.shape[2]
    qn = (_l2norm(q.double()) * q.shape[-1] ** -0.5)[0].repeat_interleave(groups, dim=1)
    kn = _l2norm(k.double())[0].repeat_interleave(groups, dim=1)
    vv = v.double()[0]
    T, H, K = kn.shape
    state = torch.zeros(H, K, vv.shape[-1], dtype=torch.float64)
    out = torch.empty_like(vv)
    for t in range(T):
        state = state * g[t].exp()[:, None, None]
        pred = torch.einsum("hkv,hk->hv", state, kn[t])
        state = state + torch.einsum("hk,hv->hkv", kn[t], (vv[t] - pred) * beta[t][:, None])
        out[t] = torch.einsum("hkv,hk->hv", state, qn[t])
    return out[None]


def check_inputs(shapes: CheckShapes, device, tokens: int):
    """q, k (native key heads), v, a, b, A_log, dt_bias of `tokens` packed tokens."""
    gen, T = generator(device), tokens
    Hk, Hv, K, V = shapes.key_heads, shapes.value_heads, shapes.key_dim, shapes.value_dim
    return [randn(gen, device, 1, T, Hk, K), randn(gen, device, 1, T, Hk, K), randn(gen, device, 1, T, Hv, V),
            randn(gen, device, 1, T, Hv), randn(gen, device, 1, T, Hv), randn(gen, device, Hv, scale=0.5),
            randn(gen, device, Hv, scale=0.5)], {}


def bind(fn, boundaries, extra):
    return lambda q, k, v, a, b, A_log, dt: fn(q, k, v, a, b, A_log, dt, boundaries=boundaries)


SPEC = OpSpec("gated_delta_rule", reference="torch", check_inputs=check_inputs, bind=bind)
BACKENDS = (
    KernelBackend("gated_delta_rule", "fla", fla_gated_delta_rule, 100,
                  on_cuda_with(availability.has_fla, availability.FLA_HINT), "fla"),
    # below fla: chosen only through `fastqwen_kernel_preference` (benchmarks/h200/2026-12-05 measured it)
    KernelBackend("gated_delta_rule", "flash-qla", flashqla_gated_delta_rule, 90,
                  on_cuda_with(availability.has_flash_qla, availability.FLASH_QLA_HINT), "flash_qla",
                  limits=flashqla_limits),
    KernelBackend("gated_delta_rule", "torch", reference_gated_delta_rule, 0, always, fallback=True),
)


@hookimpl
def fastqwen_kernel_backends():
    return list(BACKENDS)
