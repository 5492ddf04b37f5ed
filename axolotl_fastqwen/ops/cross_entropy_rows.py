"""Each row's cross-entropy loss and its logits' gradient, in one Triton kernel with no host sync.

The loss of `hidden @ lm_head.T` is computed a chunk of tokens at a time (`linear_cross_entropy.py`).
Per chunk, this kernel reads each row of logits twice (an online max and sum of exponentials, then the
softmax) and writes back, in place, `softmax - onehot(target)`: the gradient of the row's loss with
respect to its logits (zero on rows whose target is ignored), and the row's loss `logsumexp - logit[target]`
in fp32. The arithmetic is fp32 in registers; the logits stay in their own (16-bit) dtype in memory.

Why not Liger's fused linear cross-entropy, which does the same per chunk: it reads the count of
counted tokens to the host (`.item()`) in forward and compares the incoming gradient with 1 on the host
(`torch.equal`) in backward. Each such sync waits until the GPU has run everything queued, so the host
loses, at the end of the forward, the lead it built up there, and the backward that follows (many small
kernels on the MoE models) starts from an empty queue. Here the counts stay on the device.
"""

from __future__ import annotations

import functools

import torch

MAX_BLOCK = 16384  # columns a program takes per step through a row


def cross_entropy_rows_reference(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int, *,
                                 gradient: bool = True) -> torch.Tensor:
    """What the kernel does, in PyTorch in at least fp32: returns the rows' losses and overwrites `logits`
    with their gradient (in place where the logits are fp32 or wider). The chunked loss's PyTorch path
    (`linear_cross_entropy.py`) and the kernel's oracle."""
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))  # the logits themselves when fp32 or wider
    valid = targets != ignore_index
    safe = torch.where(valid, targets, 0)
    lse = torch.logsumexp(x, dim=-1)
    loss = torch.where(valid, lse - x.gather(1, safe.unsqueeze(1)).squeeze(1), 0.0)
    if gradient:  # d(row loss)/d logits = softmax - onehot(target), zero on ignored rows
        grad = x.sub_(lse.unsqueeze(1)).exp_()
        grad[torch.arange(grad.shape[0], device=grad.device), safe] -= 1.0
        grad *= valid.unsqueeze(1)
        if grad is not logits:
            logits.copy_(grad)
    return loss


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def rows_kernel(x_ptr, stride, t_ptr, loss_ptr, cols, ignore_index, BLOCK: tl.constexpr,
                    GRADIENT: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = x_ptr + row * stride
        target = tl.load(t_ptr + row)
        valid = target != ignore_index
        offs = tl.arange(0, BLOCK)
        # pass 1: the running max m and the sum s of exp(x - m) over the row
        m = float("-inf")
        s = 0.0
        for start in range(0, cols, BLOCK):
            c = start + offs
            x = tl.load(base + c, mask=c < cols, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(x, axis=0))
            s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
            m = m_new
        lse = m + tl.log(s)
        picked = tl.load(base + tl.where(valid, target, 0)).to(tl.float32)
        tl.store(loss_ptr + row, tl.where(valid, lse - picked, 0.0))
        if GRADIENT:  # pass 2: softmax - onehot(target), zero on an ignored row, over the logits
            keep = tl.where(valid, 1.0, 0.0)
            for start in range(0, cols, BLOCK):
                c = start + offs
                inside = c < cols
                x = tl.load(base + c, mask=inside, other=0.0).to(tl.float32)
                g = (tl.exp(x - lse) - tl.where(c == target, 1.0, 0.0)) * keep
                tl.store(base + c, g.to(x_ptr.dtype.element_ty), mask=inside)

    return rows_kernel


def cross_entropy_rows(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int, *,
                       gradient: bool = True) -> torch.Tensor:
    """logits `[rows, V]` (unit column stride; overwritten with the gradient where `gradient`), targets
    `[rows]` -> the rows' fp32 losses `[rows]`. CUDA (or Triton's interpreter) only."""
    if logits.stride(-1) != 1:
        raise ValueError("cross_entropy_rows needs logits with unit column stride")
    rows, cols = logits.shape
    loss = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows:
        block = min(MAX_BLOCK, 1 << max(cols - 1, 1).bit_length())
        _kernel()[(rows,)](logits, logits.stride(0), targets.contiguous(), loss, cols, ignore_index,
                           BLOCK=block, GRADIENT=gradient, num_warps=16 if block >= 8192 else 4)
    return loss
