"""A token's k routed rows summed back into the token, in one kernel: `out[t] = Σⱼ src[unsort[t·k + j]]`
(plus a second source's same rows, and the shared expert's gated output, when given).

The routed experts compute on rows sorted by expert; each token's k rows are then gathered back to
token order and summed. In PyTorch that is a gather that writes all `[T·k, H]` rows again, then a
reduction that reads them once more; the input's gradient needs the same thing (the routed rows'
gradient summed per token). Here each program gathers a token's k rows straight into an fp32
accumulator, in the order j = 0..k-1 (deterministic), and writes the token once. With expert LoRA
on the down projection, the adapter's rows are the second source: their add, a full `[T·k, H]`
pass, is folded into the same sum.

Qwen3.5-MoE and Qwen3-Next add a shared expert to every token, scaled by a per-token sigmoid gate:
`routed + sigmoid(g)·shared`. In PyTorch that is a multiply and an add over `[T, H]` forward, and two
multiplies, a reduction and the sigmoid's backward in the gradient; here the forward is one more
read in the same sum, and the gradient (`shared_term_backward_*`: `sigmoid(g)·dy` and
`Σ dy·shared · σ'(g)`) one pass over `dy` and `shared`.
"""

from __future__ import annotations

import functools

import torch

BLOCK_H = 512  # columns a program takes


def routed_combine_torch(src: torch.Tensor, unsort: torch.Tensor, k: int, extra: torch.Tensor | None = None,
                         shared: torch.Tensor | None = None, gate: torch.Tensor | None = None) -> torch.Tensor:
    """(T·k, H) rows in expert order -> (T, H), each token's k rows summed, in PyTorch's ops (a CPU, or
    where the kernel is not used): `extra`'s rows added first, a gather, then a sum (fp32 inside, one
    rounding); with `shared` (T, H) and its gate logits `gate` (T, 1), `+ sigmoid(gate)·shared` in the
    same fp32 sum, in the dtype both promote to."""
    rows = src if extra is None else src + extra
    if shared is None:
        return rows[unsort].view(-1, k, src.shape[-1]).sum(dim=1)
    total = rows[unsort].view(-1, k, src.shape[-1]).sum(dim=1, dtype=torch.float32)
    total += torch.sigmoid(gate.float()).view(-1, 1) * shared.float()
    return total.to(torch.promote_types(src.dtype, shared.dtype))


def shared_term_backward_torch(grad: torch.Tensor, shared: torch.Tensor,
                               gate: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of `sigmoid(gate)·shared` for the output's gradient `grad` (T, H): (d shared, d gate),
    in fp32 inside, each in its input's dtype and shape."""
    s = torch.sigmoid(gate.float()).view(-1, 1)
    d_shared = (grad.float() * s).to(shared.dtype)
    d_gate = (grad.float() * shared.float()).sum(dim=-1, keepdim=True) * s * (1 - s)
    return d_shared, d_gate.view(gate.shape).to(gate.dtype)


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def combine_kernel(src_ptr, extra_ptr, shared_ptr, gate_ptr, unsort_ptr, out_ptr, k, cols, stride_src,
                       stride_extra, stride_shared, stride_out, HAS_EXTRA: tl.constexpr, HAS_SHARED: tl.constexpr,
                       BLOCK_H: tl.constexpr):
        token = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        mask = c < cols
        acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        for j in range(0, k):
            row = tl.load(unsort_ptr + token * k + j).to(tl.int64)
            acc += tl.load(src_ptr + row * stride_src + c, mask=mask, other=0.0).to(tl.float32)
            if HAS_EXTRA:
                acc += tl.load(extra_ptr + row * stride_extra + c, mask=mask, other=0.0).to(tl.float32)
        if HAS_SHARED:
            g = tl.load(gate_ptr + token).to(tl.float32)
            shared = tl.load(shared_ptr + token * stride_shared + c, mask=mask, other=0.0).to(tl.float32)
            acc += shared / (1.0 + tl.exp(-g))
        tl.store(out_ptr + token * stride_out + c, acc.to(out_ptr.dtype.element_ty), mask=mask)

    return combine_kernel


@functools.cache
def _shared_backward_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def shared_term_backward_kernel(grad_ptr, shared_ptr, gate_ptr, d_shared_ptr, d_gate_ptr, cols, stride_grad,
                                    stride_shared, stride_d_shared, BLOCK_H: tl.constexpr):
        token = tl.program_id(0).to(tl.int64)
        s = 1.0 / (1.0 + tl.exp(-tl.load(gate_ptr + token).to(tl.float32)))
        dot = tl.zeros([BLOCK_H], dtype=tl.float32)
        for start in range(0, cols, BLOCK_H):  # the whole row in one program: the gate's sum in a fixed order
            c = start + tl.arange(0, BLOCK_H)
            mask = c < cols
            g = tl.load(grad_ptr + token * stride_grad + c, mask=mask, other=0.0).to(tl.float32)
            shared = tl.load(shared_ptr + token * stride_shared + c, mask=mask, other=0.0).to(tl.float32)
            dot += g * shared
            tl.store(d_shared_ptr + token * stride_d_shared + c, (g * s).to(d_shared_ptr.dtype.element_ty), mask=mask)
        tl.store(d_gate_ptr + token, (tl.sum(dot, axis=0) * s * (1.0 - s)).to(d_gate_ptr.dtype.element_ty))

    return shared_term_backward_kernel


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _check_shared(shared: torch.Tensor, gate: torch.Tensor, tokens: int, cols: int) -> None:
    if shared.shape != (tokens, cols) or gate.numel() != tokens:
        raise ValueError(f"routed_combine: shared (T, H) = ({tokens}, {cols}) and one gate logit per token, got "
                         f"{tuple(shared.shape)}, {tuple(gate.shape)}")


def routed_combine_triton(src: torch.Tensor, unsort: torch.Tensor, k: int, extra: torch.Tensor | None = None,
                          shared: torch.Tensor | None = None, gate: torch.Tensor | None = None) -> torch.Tensor:
    """The same, in one Triton kernel (not differentiable: the callers' autograd functions use it)."""
    import triton

    if src.dim() != 2 or unsort.shape != src.shape[:1] or src.shape[0] % k:
        raise ValueError(f"routed_combine: src (T·k, H) and one index per row, got {tuple(src.shape)}, "
                         f"{tuple(unsort.shape)}, k={k}")
    if extra is not None and extra.shape != src.shape:
        raise ValueError(f"routed_combine: extra {tuple(extra.shape)} must match src {tuple(src.shape)}")
    src, unsort = _rows(src), unsort.contiguous()
    extra = _rows(extra) if extra is not None else None
    tokens, cols = src.shape[0] // k, src.shape[1]
    dtype = src.dtype
    if shared is not None:
        _check_shared(shared, gate, tokens, cols)
        shared, gate, dtype = _rows(shared), gate.reshape(-1).contiguous(), torch.promote_types(dtype, shared.dtype)
    out = torch.empty(tokens, cols, dtype=dtype, device=src.device)
    if tokens:
        _kernel()[(tokens, triton.cdiv(cols, BLOCK_H))](
            src, extra if extra is not None else src, shared if shared is not None else src,
            gate if gate is not None else src, unsort, out, k, cols, src.stride(0),
            extra.stride(0) if extra is not None else 0, shared.stride(0) if shared is not None else 0, out.stride(0),
            HAS_EXTRA=extra is not None, HAS_SHARED=shared is not None, BLOCK_H=BLOCK_H)
    return out


def shared_term_backward_triton(grad: torch.Tensor, shared: torch.Tensor,
                                gate: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`shared_term_backward_torch` in one Triton kernel: a program per token reads its `grad` and `shared`
    rows once and writes both gradients."""
    tokens, cols = shared.shape
    _check_shared(shared, gate, tokens, cols)
    if grad.shape != shared.shape:
        raise ValueError(f"routed_combine: grad {tuple(grad.shape)} must match shared {tuple(shared.shape)}")
    grad, shared, flat = _rows(grad), _rows(shared), gate.reshape(-1).contiguous()
    d_shared = torch.empty(tokens, cols, dtype=shared.dtype, device=shared.device)
    d_gate = torch.empty(tokens, dtype=gate.dtype, device=gate.device)
    if tokens:
        _shared_backward_kernel()[(tokens,)](grad, shared, flat, d_shared, d_gate, cols, grad.stride(0),
                                             shared.stride(0), d_shared.stride(0), BLOCK_H=BLOCK_H)
    return d_shared, d_gate.view(gate.shape)
