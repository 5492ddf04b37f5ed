"""`ops/cross_entropy_rows.py` and the `triton` backend of the loss (`ops/linear_cross_entropy.py`).

The Triton kernel runs here in Triton's interpreter (`TRITON_INTERPRET=1`, a subprocess); on the GPU
`tests/test_gpu_kernels.py::test_triton_loss_has_no_host_sync_and_keeps_up_with_liger_cross_entropy` runs it at Qwen's vocabulary.
References: PyTorch's fp32 cross-entropy on the whole logits (transformers' definition), never the kernel.
Tolerances: 1e-5 relative in fp32 (the online max-and-sum against `logsumexp`'s order); with bf16 logits,
the gradient is rounded to bf16 on the way out: one bf16 step, 2^-7 at the bottom of a binade, because the
interpreter's downcast truncates where the reference (and the GPU) round to nearest (about half the
elements then differ by a step; the fp32 values agree to 1e-6).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

INTERPRETED = r"""
import torch
import torch.nn.functional as F
from axolotl_fastqwen.ops import cross_entropy_rows as rows_mod
from axolotl_fastqwen.ops.cross_entropy_rows import cross_entropy_rows, cross_entropy_rows_reference
from axolotl_fastqwen.ops.linear_cross_entropy import (linear_cross_entropy, reference_cross_entropy,
                                                       triton_linear_cross_entropy)

def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))

worst = {}
g = torch.Generator().manual_seed(0)
for max_block in (16384, 256):  # one block a row, and the online max and sum over several
    rows_mod.MAX_BLOCK = max_block
    for dtype in (torch.float32, torch.bfloat16):
        for rows, cols in ((7, 1000), (5, 3001), (0, 50)):
            logits = (torch.randn(rows, cols, generator=g) * 4).to(dtype)
            targets = torch.randint(0, cols, (rows,), generator=g)
            if rows:
                targets[0], targets[-1] = 0, cols - 1  # the first and last columns
                targets[rows // 2] = -100  # an ignored row: no loss, no gradient
            ours, ref = logits.clone(), logits.clone()
            loss = cross_entropy_rows(ours, targets, -100)
            ref_loss = cross_entropy_rows_reference(ref, targets, -100)
            assert loss.dtype == torch.float32 and loss.shape == (rows,)
            if rows:
                assert float(loss[rows // 2]) == 0.0 and not ours[rows // 2].any()
                key = str(dtype)
                worst[key] = max(worst.get(key, 0.0), rel(loss, ref_loss), rel(ours, ref))
            untouched = logits.clone()
            loss_only = cross_entropy_rows(untouched, targets, -100, gradient=False)
            assert torch.equal(untouched, logits) and torch.equal(loss_only, loss)
rows_mod.MAX_BLOCK = 256
# the backend: chunked loop, num_items_in_batch, a chunk boundary inside the row, lm_head's gradient too
for num_items, chunk in ((None, 7), (41, 1000)):
    h = torch.randn(1, 30, 16, generator=g, dtype=torch.float64).float().requires_grad_()
    w = (torch.randn(700, 16, generator=g) * 0.5).requires_grad_()
    labels = torch.randint(0, 700, (1, 30), generator=g)
    labels[0, :4] = -100
    targets = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
    n = torch.tensor(num_items) if num_items else None
    loss = triton_linear_cross_entropy(h, w, targets, num_items_in_batch=n, chunk_tokens=chunk)
    dh, dw = torch.autograd.grad(loss * 3.0, [h, w])  # an incoming gradient other than 1
    ref = reference_cross_entropy(h @ w.T, targets, n)
    rh, rw = torch.autograd.grad(ref * 3.0, [h, w])
    worst["backend"] = max(worst.get("backend", 0.0), rel(loss.detach(), ref.detach()), rel(dh, rh), rel(dw, rw))
    with torch.no_grad():  # eval: the loss alone
        assert rel(triton_linear_cross_entropy(h, w, targets, num_items_in_batch=n, chunk_tokens=chunk), ref) < 1e-5
# a batch with nothing to learn: 0, and zero gradients (not NaN)
h = torch.randn(1, 8, 16, requires_grad=True)
loss = triton_linear_cross_entropy(h, torch.randn(50, 16), torch.full((1, 8), -100))
loss.backward()
assert float(loss) == 0.0 and not h.grad.any()
print(worst)
print("ok")
"""


def _interpreted(script: str) -> str:
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600,
                          cwd=Path(__file__).resolve().parent.parent)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout[-2000:] + done.stderr[-3000:]
    return done.stdout


def test_the_kernel_and_the_triton_loss_match_pytorch_s_cross_entropy_in_the_interpreter():
    """Row losses and in-place gradients against PyTorch's fp32 math (one block a row and several; first,
    last and ignored targets; no rows; fp32 and bf16 logits; loss only); the backend against transformers'
    loss on the full logits: loss, hidden and lm_head gradients under an incoming gradient of 3, with
    `num_items_in_batch`, chunks that split the row, in eval, and on a batch with no counted token."""
    out = _interpreted(INTERPRETED)
    worst = eval(out.strip().splitlines()[-2])  # noqa: S307 - our own subprocess's dict of floats
    assert worst["torch.float32"] <= 1e-5 and worst["backend"] <= 1e-5, worst
    assert worst["torch.bfloat16"] <= 2**-7, worst


def test_the_triton_loss_is_opt_in_below_liger():
    """Chosen only through `fastqwen_kernel_preference` until a same-run benchmark measures it; on a CPU it
    says why it cannot run."""
    import torch

    from axolotl_fastqwen.ops.linear_cross_entropy import BACKENDS

    by_name = {b.name: b for b in BACKENDS}
    assert by_name["liger"].priority > by_name["triton"].priority > by_name["torch-chunked"].priority
    assert "needs a CUDA device" in by_name["triton"].available(torch.device("cpu"))
