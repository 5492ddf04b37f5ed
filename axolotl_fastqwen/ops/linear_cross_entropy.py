"""Cross-entropy of `hidden @ lm_head.T` without ever holding the full logits.

With Qwen's 248,320-token vocabulary, 8,192 tokens of fp32 logits are 7.7 GB (users report OOMs
in the loss). Here the tokens are processed in chunks: each chunk's logits exist only while its
loss and its gradients w.r.t. the hidden states (and, in full fine-tuning, the lm_head weight) are
computed, during the forward. Backward only scales the stored gradients. The loss is defined
exactly as transformers' `ForCausalLMLoss` (shifted labels, -100 ignored, sum over
`num_items_in_batch` when the Trainer passes it, else the mean).
"""

from __future__ import annotations

import functools

import torch

from ..hookspecs import hookimpl
from . import availability
from .backend import CheckShapes, KernelBackend, OpSpec, always, generator, on_cuda_with, randn
from .cross_entropy_rows import cross_entropy_rows, cross_entropy_rows_reference

IGNORE_INDEX = -100
# Elements of fp32 logits held at once (~1 GiB): 1,081 tokens at a 248k vocabulary.
CHUNK_ELEMENTS = 1 << 28
# The fewest tokens in one of Liger's chunks. Each chunk reads all of lm_head's weight and does M FLOP per
# byte of it (M: the chunk's tokens); below about 300 (an H100's bf16 peak over its memory bandwidth, ~200
# on an H200) the loss's two GEMMs wait on memory. Liger sizes chunks so that their logits match the input
# (tokens x hidden elements): 128 tokens at the 35B-A3B's hidden 2048 and 248k vocabulary, where its GEMMs
# ran at 350 TFLOP/s, 47.7 of the step's 295 ms of GPU kernel time (benchmarks/h100/2026-12-07b). 512
# tokens of bf16 logits at that vocabulary are 254 MB.
LIGER_MIN_CHUNK_TOKENS = 512


def shift_labels(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Targets of each position (the next label), as transformers' causal LM loss shifts them."""
    return torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    num_items_in_batch: torch.Tensor | int | None = None,
    ignore_index: int = IGNORE_INDEX,
    chunk_tokens: int | None = None,
    rows_kernel=None,
) -> torch.Tensor:
    """Loss of `hidden @ weight.T` against already-shifted `targets`.

    hidden `[..., H]`, weight `[V, H]`, targets `[...]`. Returns a 0-dim fp32 tensor: the sum of
    per-token losses over `num_items_in_batch` if given, else their mean; 0 with zero gradients when
    no token counts (where PyTorch would give NaN): such a batch trains nothing, as it should.
    `rows_kernel`: None, each chunk's loss and gradient from fp32 logits in PyTorch
    (`cross_entropy_rows_reference`); else `cross_entropy_rows`, on logits in the GEMM's dtype.
    """
    h = hidden.reshape(-1, hidden.shape[-1])
    t = targets.reshape(-1).to(h.device)
    if chunk_tokens is None:
        chunk_tokens = max(1, CHUNK_ELEMENTS // weight.shape[0])
    normalizer = _normalizer(t, num_items_in_batch, ignore_index, torch.promote_types(h.dtype, torch.float32))
    return _ChunkedLinearCrossEntropy.apply(h, weight, t, normalizer, ignore_index, chunk_tokens, rows_kernel)


def triton_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    num_items_in_batch: torch.Tensor | int | None = None,
    ignore_index: int = IGNORE_INDEX,
    chunk_tokens: int | None = None,
) -> torch.Tensor:
    """`linear_cross_entropy` with each chunk's loss and logits gradient in one Triton kernel
    (`cross_entropy_rows.py`), same contract. Why: what Liger's fused loss does, without its three
    host syncs a step; chunks of `CHUNK_ELEMENTS` logits (1,081 tokens at a 248k vocabulary)."""
    return linear_cross_entropy(hidden, weight, targets, num_items_in_batch=num_items_in_batch,
                                ignore_index=ignore_index, chunk_tokens=chunk_tokens, rows_kernel=cross_entropy_rows)


def liger_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    num_items_in_batch: torch.Tensor | int | None = None,
    ignore_index: int = IGNORE_INDEX,
    chunk_tokens: int | None = None,
) -> torch.Tensor:
    """`linear_cross_entropy` on Liger-Kernel's Triton kernel (CUDA only), same contract.

    Why: one Triton pass over each logits chunk yields loss and gradient, where the torch path
    makes ~6 fp32 elementwise passes over the 248k-wide logits. Liger's chunks are made at least
    `LIGER_MIN_CHUNK_TOKENS` long through its `chunk_mem_const` (`chunk_tokens` is ignored): the same
    per-token results, from fewer, compute-bound GEMMs.
    """
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    h = hidden.reshape(-1, hidden.shape[-1]).contiguous()  # Liger 0.8.4 rescales grads assuming unit column stride
    t = targets.reshape(-1).to(h.device).contiguous()
    # reduction="sum" over our own normalizer (Liger's "mean" cannot take num_items_in_batch);
    # lm_head's gradient (full fine-tuning) accumulated in fp32, as the torch path does.
    loss = liger_fused_linear_cross_entropy(
        h, weight.contiguous(), t, ignore_index=ignore_index, reduction="sum", accum_dtype=torch.float32,
        chunk_mem_const=liger_chunk_mem_const(h.shape[0], h.shape[1], weight.shape[0], LIGER_MIN_CHUNK_TOKENS),
    )
    return loss / _normalizer(t, num_items_in_batch, ignore_index, torch.float32)


@functools.lru_cache(maxsize=64)
def liger_chunk_mem_const(tokens: int, hidden: int, vocab: int, min_tokens: int) -> int:
    """The smallest `chunk_mem_const` for which Liger's chunks hold at least `min_tokens` tokens (or all of
    them). Liger >= 0.8.4 takes `ceil(vocab / (const * hidden))` chunks' worth of tokens, rounded up to a
    power of two (`fused_linear_cross_entropy_forward`); const 1 is its default."""
    const = 1
    while _liger_chunk_tokens(tokens, hidden, vocab, const) < min(min_tokens, tokens):
        const += 1
    return const


def _liger_chunk_tokens(tokens: int, hidden: int, vocab: int, const: int) -> int:
    per_chunk = -(-vocab // (const * hidden))
    return min(1 << (-(-tokens // per_chunk) - 1).bit_length(), tokens)


def liger_limits(hidden, weight, targets, **kwargs) -> str | None:
    """Liger computes no weight gradient unless its input needs one: lm_head's would be lost."""
    if torch.is_grad_enabled() and weight.requires_grad and not hidden.requires_grad:
        return "a trainable lm_head under frozen hidden states (Liger would give lm_head no gradient)"
    return None


def _normalizer(t: torch.Tensor, num_items_in_batch, ignore_index: int, dtype: torch.dtype) -> torch.Tensor:
    """The loss's denominator, one definition for every backend: num_items_in_batch (the Trainer's
    count across gradient-accumulation steps) if given, else this batch's counted tokens; at least 1.

    Why at least 1: a step with no trainable token (`num_items_in_batch == 0`) has a loss sum of 0,
    and 0 / 0 would put NaN into every gradient and, through the optimizer, into every weight;
    0 / 1 is the right answer (nothing to learn). stock `ForCausalLMLoss` returns NaN there."""
    if num_items_in_batch is None:
        return (t != ignore_index).sum().clamp(min=1).to(dtype)
    return torch.as_tensor(num_items_in_batch, device=t.device).to(dtype).clamp(min=1)


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, targets, normalizer, ignore_index, chunk_tokens, rows_kernel):
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        acc = torch.promote_types(h.dtype, torch.float32)  # logits and sums in at least fp32
        grad_h = torch.empty_like(h) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        loss = torch.zeros((), dtype=acc, device=h.device)
        for start in range(0, h.shape[0], chunk_tokens):
            hc = h[start : start + chunk_tokens]
            tc = targets[start : start + chunk_tokens]
            logits = hc @ weight.T
            if rows_kernel is None:  # PyTorch's ops, on fp32 logits
                logits = logits.to(acc)
            # the row losses, and the logits overwritten with their gradient
            loss += (rows_kernel or cross_entropy_rows_reference)(logits, tc, ignore_index, gradient=need_h or need_w).sum()
            if not (need_h or need_w):
                continue
            grad = logits.to(h.dtype)
            if need_h:
                grad_h[start : start + chunk_tokens] = grad @ weight
            if need_w:
                grad_w += (grad.T @ hc).to(acc)
        ctx.save_for_backward(grad_h, grad_w, normalizer)
        ctx.weight_dtype = weight.dtype
        return loss / normalizer

    @staticmethod
    def backward(ctx, grad_loss):
        grad_h, grad_w, normalizer = ctx.saved_tensors
        scale = grad_loss / normalizer
        dh = (grad_h * scale.to(grad_h.dtype)) if grad_h is not None else None
        dw = (grad_w * scale).to(ctx.weight_dtype) if grad_w is not None else None
        return dh, dw, None, None, None, None, None


def reference_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, num_items_in_batch=None) -> torch.Tensor:
    """transformers' definition on materialised logits (tests only)."""
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = torch.nn.functional.cross_entropy(
        logits.to(torch.promote_types(logits.dtype, torch.float32)).reshape(-1, logits.shape[-1]),
        targets.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction=reduction,
    )
    return loss / num_items_in_batch if num_items_in_batch is not None else loss


# The loss is checked at a small hidden size and vocabulary (the real 248k-wide fp32 reference would
# take GBs), wider than Liger's 32,768-column block so that its loop over blocks and masked tail run.
CHECK_HIDDEN, CHECK_VOCAB = 256, 40_000


def check_inputs(shapes: CheckShapes, device, tokens: int):
    """hidden [T, H], lm_head [V, H] (logits ~ N(0, 4)) and targets with every fifth ignored."""
    gen, H, V = generator(device), CHECK_HIDDEN, CHECK_VOCAB
    targets = torch.randint(0, V, (tokens,), generator=gen, device=device)
    targets[::5] = IGNORE_INDEX  # ignored tokens must get no loss and no gradient
    return [randn(gen, device, tokens, H), randn(gen, device, V, H, scale=2 * H**-0.5), targets], {}


def bind(fn, boundaries, extra):
    return lambda hidden, weight, targets: fn(hidden, weight, targets, **extra)


# torch-chunked is exact in fp32 yet fast enough that `require` need not refuse it: the oracle, not a fallback
SPEC = OpSpec("linear_cross_entropy", reference="torch-chunked", check_inputs=check_inputs, bind=bind)
BACKENDS = (
    KernelBackend("linear_cross_entropy", "liger", liger_linear_cross_entropy, 100,
                  on_cuda_with(availability.has_liger, availability.LIGER_HINT), "liger_kernel", limits=liger_limits),
    # below Liger: chosen only through `fastqwen_kernel_preference` until a same-run benchmark measures it
    KernelBackend("linear_cross_entropy", "triton", triton_linear_cross_entropy, 90,
                  on_cuda_with(availability.has_triton, availability.TRITON_HINT), "triton"),
    # chunked matmuls: cuBLAS does the work; the CPU path, and a sound GPU one
    KernelBackend("linear_cross_entropy", "torch-chunked", linear_cross_entropy, 0, always),
)


@hookimpl
def fastqwen_kernel_backends():
    return list(BACKENDS)
