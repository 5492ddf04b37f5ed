"""The PyTorch reference ops: pinned to their definitions and to the stock transformers layers.

These references are the CPU training path and the oracle every GPU kernel is checked against,
so they are held to float64 round-off against the definition and to bitwise / fp32 round-off
equality with the stock layers they replace.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
import torch.nn.functional as F

from axolotl_fastqwen import registry
from axolotl_fastqwen.boundaries import Boundaries
from axolotl_fastqwen.ops.causal_conv import reference_causal_conv
from axolotl_fastqwen.ops.gated_delta_rule import naive_recurrence, reference_gated_delta_rule
from axolotl_fastqwen.ops.gated_rmsnorm import reference_gated_rmsnorm
from axolotl_fastqwen.ops.linear_cross_entropy import (
    liger_linear_cross_entropy,
    linear_cross_entropy,
    reference_cross_entropy,
    shift_labels,
)
from axolotl_fastqwen.ops.varlen_attention import reference_varlen_attention
from axolotl_fastqwen.transformers_functions import stock_torch_kernels, torch_fallback

CPU = torch.device("cpu")
LENGTHS = [37, 1, 64, 90]  # a 1-token sequence, a chunk-aligned one, unaligned starts


def boundaries(lengths=LENGTHS):
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    return Boundaries.from_cu_seqlens(cu, device=CPU, host=cu)


def rel(a, b):
    return float((a - b).norm() / b.norm())


def gdn_inputs(T, Hk=2, Hv=4, K=16, V=8, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=dtype)  # noqa: E731
    return r(1, T, Hk, K), r(1, T, Hk, K), r(1, T, Hv, V), r(1, T, Hv), r(1, T, Hv), r(Hv) * 0.5, r(Hv) * 0.5


def test_chunked_gated_delta_rule_equals_token_recurrence_float64():
    q, k, v, a, b, A_log, dt = gdn_inputs(150)
    assert rel(reference_gated_delta_rule(q, k, v, a, b, A_log, dt), naive_recurrence(q, k, v, a, b, A_log, dt)) < 1e-12


def test_gated_delta_rule_matches_transformers_torch_fallback_bitwise():
    from transformers.models.qwen3_5 import modeling_qwen3_5 as mq

    q, k, v, a, b, A_log, dt = (t.float() for t in gdn_inputs(150))
    ours = reference_gated_delta_rule(q, k, v, a, b, A_log, dt)
    g = -A_log.exp() * F.softplus(a + dt)
    stock, _ = torch_fallback(mq.torch_chunk_gated_delta_rule)(
        q.repeat_interleave(2, 2), k.repeat_interleave(2, 2), v, g=g, beta=b.sigmoid(), use_qk_l2norm_in_kernel=True
    )
    assert torch.equal(ours, stock)


def test_varlen_gated_delta_rule_is_each_sequence_alone():
    T = sum(LENGTHS)
    q, k, v, a, b, A_log, dt = gdn_inputs(T)
    packed = reference_gated_delta_rule(q, k, v, a, b, A_log, dt, boundaries=boundaries())
    starts = [0, *torch.tensor(LENGTHS).cumsum(0).tolist()]
    alone = torch.cat(
        [reference_gated_delta_rule(*(t[:, s:e] for t in (q, k, v, a, b)), A_log, dt) for s, e in zip(starts, starts[1:])], 1
    )
    assert rel(packed, alone) < 1e-14
    # and without boundaries the same row is NOT the same: state flows across (the leak we prevent)
    leaky = reference_gated_delta_rule(q, k, v, a, b, A_log, dt)
    assert rel(leaky[:, LENGTHS[0] :], alone[:, LENGTHS[0] :]) > 1e-2


def test_causal_conv_with_boundaries_is_each_sequence_alone():
    g = torch.Generator().manual_seed(0)
    x, w, bias = torch.randn(1, sum(LENGTHS), 12, generator=g), torch.randn(12, 4, generator=g), torch.randn(12, generator=g)
    packed = reference_causal_conv(x, w, bias, activation="silu", boundaries=boundaries())
    starts = [0, *torch.tensor(LENGTHS).cumsum(0).tolist()]
    alone = torch.cat([reference_causal_conv(x[:, s:e], w, bias, activation="silu") for s, e in zip(starts, starts[1:])], 1)
    assert rel(packed, alone) < 1e-6
    leaky = reference_causal_conv(x, w, bias, activation="silu")
    assert rel(leaky, alone) > 1e-3


def test_causal_conv_without_boundaries_is_the_stock_conv_bitwise():
    from transformers.models.qwen3_5 import modeling_qwen3_5 as mq

    x, w = torch.randn(2, 50, 12), torch.randn(12, 4)
    stock = torch_fallback(mq.causal_conv1d_fn)(x.transpose(1, 2), w, None, activation="silu").transpose(1, 2)
    assert torch.equal(reference_causal_conv(x, w, None, activation="silu"), stock)


def test_gated_rmsnorm_is_the_stock_module_bitwise():
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNormGated

    norm = Qwen3_5RMSNormGated(16, eps=1e-6)
    norm.weight.data = torch.randn(16)
    x, z = torch.randn(30, 16), torch.randn(30, 16)
    assert torch.equal(reference_gated_rmsnorm(x, z, norm.weight, eps=1e-6), norm(x, z))


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe", "qwen3_next"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_is_each_familys_stock_module_bitwise(family, dtype):
    """The rms_norm reference is what every family's RMSNorm class computes, forward and backward,
    bit for bit (it is the CPU path, and what runs where Liger is not installed)."""
    from axolotl_fastqwen.ops.rms_norm import reference_rms_norm

    plan = registry.family(family).resolve()
    (cls,) = plan.rms_norm
    norm = cls(16, eps=1e-6).to(dtype)
    norm.weight.data = 0.1 * torch.randn(16, dtype=dtype)
    x = torch.randn(3, 10, 16, dtype=dtype, requires_grad=True)
    dy = torch.randn(3, 10, 16, dtype=dtype)
    ours = reference_rms_norm(x, norm.weight, eps=1e-6)
    (dx_ours, dw_ours) = torch.autograd.grad(ours, (x, norm.weight), dy)
    stock = norm(x)
    (dx, dw) = torch.autograd.grad(stock, (x, norm.weight), dy)
    assert torch.equal(ours, stock) and torch.equal(dx_ours, dx) and torch.equal(dw_ours, dw)


def test_a_family_rms_norm_class_replaced_by_another_library_is_not_patched(monkeypatch):
    """`liger_rms_norm` swaps the modeling module's RMSNorm name for Liger's class before the model is
    built: the plan takes only transformers' own class, so the plugin leaves those norms to Liger,
    and the report says the op is off."""
    from axolotl_fastqwen import patch_model, unpatch_model
    from test_patching import model_for

    plan = registry.family("qwen3_5").resolve()
    (stock,) = plan.rms_norm
    foreign = type("LigerLikeRMSNorm", (stock,), {"__module__": "liger_kernel.transformers.rms_norm"})
    monkeypatch.setattr(plan.module, stock.__name__, foreign)
    assert registry.family("qwen3_5").resolve().rms_norm == ()
    model = model_for("qwen3_5")  # built after the swap: its norms are the foreign class
    assert type(model.model.layers[0].input_layernorm) is foreign
    report = patch_model(model, log=False)
    try:
        assert report.rms_norms == 0 and report.backends()["rms_norm"].startswith("off")
        assert not any("forward" in vars(layer.input_layernorm) for layer in model.model.layers)
    finally:
        unpatch_model(model)


def test_a_norm_whose_forward_another_integration_bound_is_not_patched():
    """Liger's `apply_liger_kernel_to_qwen3_5(model=...)` binds LigerRMSNorm.forward to the existing
    norm instances: those keep it; the others are the plugin's."""
    import types as _types

    from axolotl_fastqwen import patch_model, unpatch_model
    from test_patching import model_for

    def theirs(self, x):
        return x

    model = model_for("qwen3_5")
    bound = model.model.layers[0].input_layernorm
    bound.forward = _types.MethodType(theirs, bound)
    report = patch_model(model, log=False)
    try:
        assert report.rms_norms == 4 * 2 + 2 + 1 - 1
        assert bound.forward.__func__ is theirs
        assert type(vars(model.model.layers[0].post_attention_layernorm)["forward"]).__name__ == "PatchedForward"
    finally:
        unpatch_model(model)
    assert bound.forward.__func__ is theirs and "forward" not in vars(model.model.layers[0].post_attention_layernorm)


def test_varlen_attention_is_block_diagonal_causal_attention():
    T, Hq, Hkv, D = sum(LENGTHS), 4, 2, 16
    q, k, v = torch.randn(T, Hq, D), torch.randn(T, Hkv, D), torch.randn(T, Hkv, D)
    ours = reference_varlen_attention(q, k, v, boundaries=boundaries(), scale=D**-0.5)
    seq = torch.repeat_interleave(torch.arange(len(LENGTHS)), torch.tensor(LENGTHS))
    allowed = (seq[:, None] == seq[None, :]) & torch.ones(T, T, dtype=torch.bool).tril()
    full = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.repeat_interleave(2, 1).transpose(0, 1), v.repeat_interleave(2, 1).transpose(0, 1),
        attn_mask=allowed, scale=D**-0.5,
    ).transpose(0, 1)
    assert rel(ours, full) < 1e-6


@pytest.mark.parametrize("lengths", [[70, 3, 64, 9, 80, 1], [100, 20], [5, 90], [10, 20, 30]])
def test_long_sequences_on_sdpa_is_block_diagonal_causal_attention(lengths, monkeypatch):
    """The cudnn-long backend's split, on CPU with the long-sequence length lowered to 64: long
    sequences alone through SDPA, each run of short ones (first, between, last, or the whole row)
    through the varlen path over its own window, and the pieces back in row order; forward and
    input gradients of block-diagonal causal attention (fp32; measured ~1e-7)."""
    from axolotl_fastqwen.ops import varlen_attention

    monkeypatch.setattr(varlen_attention, "LONG_SEQUENCE", 64)
    windows = []

    def short(q, k, v, *, boundaries, **kw):
        windows.append(boundaries.lengths())
        assert boundaries.seq_idx.shape[1] == q.shape[0] == boundaries.total
        return reference_varlen_attention(q, k, v, boundaries=boundaries, **kw)

    T, Hq, Hkv, D = sum(lengths), 4, 2, 16
    inputs = [torch.randn(T, h, D, dtype=torch.float64, requires_grad=True) for h in (Hq, Hkv, Hkv)]
    b = boundaries(lengths)
    ours = varlen_attention.long_sequences_on_sdpa(*inputs, boundaries=b, scale=D**-0.5, short=short)
    grad = torch.randn_like(ours)
    ours_grads = torch.autograd.grad(ours, inputs, grad)
    ref = reference_varlen_attention(*inputs, boundaries=b, scale=D**-0.5)
    ref_grads = torch.autograd.grad(ref, inputs, grad)
    assert rel(ours, ref) < 1e-6 and all(rel(a, r) < 1e-6 for a, r in zip(ours_grads, ref_grads))
    runs, run = [], []
    for n in lengths:  # the runs of short sequences the split must hand to the varlen path
        if n < 64:
            run.append(n)
        elif run:
            runs, run = runs + [run], []
    assert windows == runs + ([run] if run else []) or (max(lengths) < 64 and windows == [lengths])


@pytest.mark.parametrize("num_items", [None, 57])
@pytest.mark.parametrize("weight_grad", [True, False])
def test_linear_cross_entropy_matches_transformers_loss_and_grads(num_items, weight_grad):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(2, 40, 32, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(300, 32, generator=g, dtype=torch.float64, requires_grad=weight_grad)
    labels = torch.randint(0, 300, (2, 40), generator=g)
    labels[0, :5] = -100
    targets = shift_labels(labels)
    n = torch.tensor(num_items) if num_items else None
    ours = linear_cross_entropy(h, w, targets, num_items_in_batch=n, chunk_tokens=7)  # chunks not dividing 80
    ours.backward()
    grads = (h.grad.clone(), w.grad.clone() if weight_grad else None)
    h.grad = None
    if weight_grad:
        w.grad = None
    ref = reference_cross_entropy(h @ w.T, targets, n)
    ref.backward()
    assert abs(float(ours.detach() - ref.detach())) < 1e-12 * abs(float(ref.detach()))
    assert rel(grads[0], h.grad) < 1e-12
    if weight_grad:
        assert rel(grads[1], w.grad) < 1e-12
    else:
        assert w.grad is None


def test_linear_cross_entropy_of_a_batch_without_targets_is_zero_not_nan():
    h = torch.randn(1, 8, 4, requires_grad=True)
    loss = linear_cross_entropy(h, torch.randn(10, 4), torch.full((1, 8), -100))
    loss.backward()
    assert float(loss) == 0.0 and torch.count_nonzero(h.grad) == 0


@pytest.fixture
def liger_stand_in(monkeypatch):
    """Liger's functional API with its sum-reduction semantics in PyTorch: its Triton kernel needs CUDA
    (tests/test_gpu_kernels.py compares the real one); here what our wrapper adds is checked."""
    calls = []

    def fused(input, weight, target, *, ignore_index, reduction, accum_dtype, chunk_mem_const):
        calls.append((input.is_contiguous(), input.dim(), reduction, accum_dtype))
        logits = (input @ weight.T).float()
        return F.cross_entropy(logits, target, ignore_index=ignore_index, reduction=reduction)

    module = types.ModuleType("liger_kernel.transformers.functional")
    module.liger_fused_linear_cross_entropy = fused
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.functional", module)
    return calls


@pytest.mark.parametrize("num_items", [None, 57])
@pytest.mark.parametrize("grads", ["hidden", "hidden+weight", "weight"])
def test_liger_wrapper_has_the_torch_contract(num_items, grads, liger_stand_in):
    """Called as the patched head calls it (through the model's KernelSet, Liger chosen)."""
    from axolotl_fastqwen.kernel_choice import KernelChoice, KernelSet
    from axolotl_fastqwen.ops.linear_cross_entropy import BACKENDS

    liger, chunked = (next(b for b in BACKENDS if b.name == n) for n in ("liger", "torch-chunked"))
    kernels = KernelSet({"linear_cross_entropy": KernelChoice(liger)}, torch.device("cpu"), "auto",
                        {"linear_cross_entropy": chunked})
    g = torch.Generator().manual_seed(0)
    h = torch.randn(2, 32, 40, generator=g).transpose(1, 2).requires_grad_("hidden" in grads)  # not contiguous
    w = torch.randn(300, 32, generator=g).requires_grad_("weight" in grads)
    labels = torch.randint(0, 300, (2, 40), generator=g)
    labels[0, :5] = -100
    targets = shift_labels(labels)
    n = torch.tensor(num_items) if num_items else None
    leaves = [x for x in (h, w) if x.requires_grad]
    ours = kernels.linear_cross_entropy(h, w, targets, num_items_in_batch=n)
    got = torch.autograd.grad(ours, leaves)
    ref = reference_cross_entropy(h @ w.T, targets, n)
    assert ours.dtype == torch.float32 and ours.dim() == 0
    assert rel(ours.detach(), ref.detach()) < 1e-6
    assert all(rel(a, b) < 1e-5 for a, b in zip(got, torch.autograd.grad(ref, leaves), strict=True))
    # Liger drops lm_head's gradient when hidden needs none: that call takes the torch path, and says so
    expected = [] if grads == "weight" else [(True, 2, "sum", torch.float32)]  # contiguous, flat, summed, fp32 dW
    assert liger_stand_in == expected
    handed_over = [note for note in kernels.notes if "liger hands calls with a trainable lm_head" in note]
    assert len(handed_over) == (1 if grads == "weight" else 0), kernels.notes


def test_liger_wrapper_of_a_batch_without_targets_is_zero_not_nan(liger_stand_in):
    h = torch.randn(1, 8, 4, requires_grad=True)
    loss = liger_linear_cross_entropy(h, torch.randn(10, 4), torch.full((1, 8), -100))
    loss.backward()
    assert float(loss.detach()) == 0.0 and torch.count_nonzero(h.grad) == 0


@pytest.fixture
def liger_ce_kernel_stand_in(monkeypatch):
    """Liger's own Python (chunking, GEMMs, gradient buffers) with its two Triton kernels in PyTorch (they need
    CUDA): the per-row loss and in-place logits gradient, whose launches' rows are recorded, and backward's
    in-place scaling by the loss's incoming gradient."""
    flce = pytest.importorskip("liger_kernel.ops.fused_linear_cross_entropy")
    launches = []

    def launch(X_ptr, Y_ptr, loss_ptr, n_non_ignore, ignore_index, reduction, HAS_GRADIENTS, **_):
        launches.append(X_ptr.shape[0])
        x, valid = X_ptr.float(), Y_ptr != ignore_index
        target = torch.where(valid, Y_ptr, 0)
        lse = x.logsumexp(-1)
        loss_ptr.copy_(torch.where(valid, lse - x.gather(1, target[:, None])[:, 0], 0.0))
        if HAS_GRADIENTS:
            grad = (x - lse[:, None]).exp()
            grad[torch.arange(len(target)), target] -= 1
            X_ptr.copy_((grad * valid[:, None] / (max(n_non_ignore, 1) if reduction == "mean" else 1)).to(X_ptr.dtype))

    def scale(X_ptr, X_stride, grad_output_ptr, n_cols, **_):
        X_ptr.mul_(grad_output_ptr)

    class Kernel:
        def __init__(self, fn):
            self.fn = fn

        def __getitem__(self, grid):
            return self.fn

    monkeypatch.setattr(flce, "liger_cross_entropy_kernel", Kernel(launch))
    monkeypatch.setattr(flce, "element_mul_kernel", Kernel(scale))
    return launches


# (tokens, hidden, vocab): the 35B-A3B's and the 27B's vocabulary-to-hidden ratios (248,320 / 2,048 and / 5,120)
# at a width a CPU affords (Liger then chose 128- and 256-token chunks, as at the real shapes), and short inputs
@pytest.mark.parametrize("tokens,hidden,vocab,liger_own", [(8192, 32, 3880, 128), (8192, 80, 3880, 256),
                                                           (300, 16, 5000, 1), (700, 16, 5000, 4), (5, 16, 5000, 1)])
def test_liger_chunks_hold_at_least_the_minimum_tokens_and_the_loss_is_unchanged(
        tokens, hidden, vocab, liger_own, liger_ce_kernel_stand_in):
    """Liger's real chunking, driven by the `chunk_mem_const` the wrapper passes: every chunk but the last
    `LIGER_MIN_CHUNK_TOKENS` long (or the whole input), where Liger's default made chunks of `liger_own`; the
    loss and the hidden gradient those of transformers' definition on the full logits (fp32, 1e-5: the
    chunked sums' order)."""
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    from axolotl_fastqwen.ops.linear_cross_entropy import LIGER_MIN_CHUNK_TOKENS

    g = torch.Generator().manual_seed(tokens + hidden)
    h = torch.randn(1, tokens, hidden, generator=g).requires_grad_()
    w = torch.randn(vocab, hidden, generator=g) * hidden**-0.5
    labels = torch.randint(0, vocab, (1, tokens), generator=g)
    labels[0, ::7] = -100
    targets = shift_labels(labels)
    liger_fused_linear_cross_entropy(h[0].detach(), w, targets[0], reduction="sum")
    assert liger_ce_kernel_stand_in[0] == liger_own
    liger_ce_kernel_stand_in.clear()
    ours = liger_linear_cross_entropy(h, w, targets)
    (grad,) = torch.autograd.grad(ours, [h])
    want = min(LIGER_MIN_CHUNK_TOKENS, tokens)
    assert liger_ce_kernel_stand_in[:-1] == [want] * (len(liger_ce_kernel_stand_in) - 1)
    assert want >= liger_ce_kernel_stand_in[-1] > 0 and sum(liger_ce_kernel_stand_in) == tokens
    ref = reference_cross_entropy(h @ w.T, targets)
    assert rel(ours.detach(), ref.detach()) < 1e-5
    assert rel(grad, torch.autograd.grad(ref, [h])[0]) < 1e-5


def test_stock_torch_kernels_context_switches_and_restores():
    from transformers.models.qwen3_5 import modeling_qwen3_5 as mq

    before = mq.torch_chunk_gated_delta_rule
    with stock_torch_kernels("qwen3_5"):
        assert torch_fallback(mq.torch_chunk_gated_delta_rule) is torch_fallback(before, "torch_chunk_gated_delta_rule")
        assert mq.torch_chunk_gated_delta_rule is not before
    assert mq.torch_chunk_gated_delta_rule is before


def test_what_stock_runs_on_a_cpu_is_what_resolved_kernel_says():
    """The stock gated delta rule called on CPU inputs: where `resolved_kernel(..., "cpu")` says
    torch, it runs and equals transformers' PyTorch function bitwise (no fla, or transformers 5.25+,
    which routes CPU inputs there itself); where it names fla, fla's Triton kernel is what runs,
    and it fails on a CPU (the crash the stock baselines and the cache path must route around)."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as mq

    from axolotl_fastqwen.transformers_functions import resolved_kernel

    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 12, 2, 8, generator=g) for _ in range(2))
    v = torch.randn(1, 12, 2, 8, generator=g)
    gate = -torch.rand(1, 12, 2, generator=g)
    beta = torch.rand(1, 12, 2, generator=g)
    args = dict(g=gate, beta=beta, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=True)
    reference, _ = torch_fallback(mq.torch_chunk_gated_delta_rule, "torch_chunk_gated_delta_rule")(q, k, v, **args)
    if resolved_kernel(mq, "torch_chunk_gated_delta_rule", "cpu") == "torch":
        out, _ = mq.torch_chunk_gated_delta_rule(q, k, v, **args)
        torch.testing.assert_close(out, reference, rtol=0, atol=0)
    else:
        assert resolved_kernel(mq, "torch_chunk_gated_delta_rule") == "fla"
        with pytest.raises(Exception):
            mq.torch_chunk_gated_delta_rule(q, k, v, **args)


def test_fla_chunk_plan_is_built_once_per_batch_not_once_per_layer():
    """fla caches `prepare_chunk_indices` (a host computation plus a blocking host-to-device copy) by
    the identity of the tensors passed; every GDN and conv layer of one forward must hit that cache.
    Reference: fla's own cache (its return object is reused), called as the layers call it."""
    index = pytest.importorskip("fla.ops.utils.index")
    b = Boundaries.from_cu_seqlens(torch.tensor([0, 37, 38, 108, 128]), device=torch.device("cpu"))
    plans = [index.prepare_chunk_indices(chunk_size=64, **b.fla_varlen()) for _layer in range(3)]
    assert all(p is plans[0] for p in plans)  # one plan for the batch: the later layers reuse it
    assert plans[0].dtype == torch.int64 and b.fla_varlen()["cu_seqlens"].tolist() == [0, 37, 38, 108, 128]


@pytest.fixture
def flash_qla_stand_in(monkeypatch):
    """FlashQLA's documented contract (`flash_qla.chunk_gated_delta_rule`: g the log decay and beta
    given ready-made, L2 norm of q/k in-kernel as x * rsqrt(sum(x^2) + 1e-6) (flash_qla/utils/math.py),
    value head h reading key head h // (Hv / Hk),
    sequences cut at `cu_seqlens`) as a token loop in float64. Its TileLang kernels need a GPU
    (tests/test_gpu_kernels.py compares the real one); here what our glue adds is checked: the
    gate, beta, scale and boundaries it hands over."""
    calls = []

    def chunk_gated_delta_rule(q, k, v, g, beta, *, scale, use_qk_l2norm_in_kernel, cu_seqlens):
        calls.append((g.dtype, beta.dtype, scale, use_qk_l2norm_in_kernel, None if cu_seqlens is None
                      else (cu_seqlens.dtype, cu_seqlens.tolist())))
        groups = v.shape[2] // q.shape[2]
        q, k = ((t.double() * (t.double() ** 2).sum(-1, keepdim=True).add(1e-6).rsqrt()).repeat_interleave(groups, dim=2)
                for t in (q, k))
        v, g, beta = v.double(), g.double(), beta.double()
        cu = cu_seqlens.tolist() if cu_seqlens is not None else [0, q.shape[1]]
        out = torch.zeros_like(v)
        for start, end in zip(cu[:-1], cu[1:]):
            state = torch.zeros(v.shape[2], q.shape[-1], v.shape[-1], dtype=torch.float64)
            for t in range(start, end):
                state = state * g[0, t].exp()[:, None, None]
                err = v[0, t] - torch.einsum("hkv,hk->hv", state, k[0, t])
                state = state + torch.einsum("hk,hv->hkv", k[0, t], err * beta[0, t][:, None])
                out[0, t] = torch.einsum("hkv,hk->hv", state, q[0, t] * scale)
        return out, None

    module = types.ModuleType("flash_qla")
    module.chunk_gated_delta_rule = chunk_gated_delta_rule
    monkeypatch.setitem(sys.modules, "flash_qla", module)
    return calls


def test_flashqla_glue_hands_over_the_gate_beta_and_boundaries_of_the_rule(flash_qla_stand_in):
    """Raw a, b in: the result is the rule of `naive_recurrence` (our definition), each sequence alone."""
    from axolotl_fastqwen.ops.gated_delta_rule import flashqla_gated_delta_rule

    q, k, v, a, b, A_log, dt_bias = gdn_inputs(sum(LENGTHS))
    out = flashqla_gated_delta_rule(q, k, v, a, b, A_log, dt_bias, boundaries=boundaries())
    cu = boundaries().cu_seqlens_host.tolist()
    for start, end in zip(cu[:-1], cu[1:]):
        piece = slice(start, end)
        alone = naive_recurrence(*(t[:, piece] for t in (q, k, v, a, b)), A_log, dt_bias)
        assert rel(out[:, piece], alone) < 1e-10
    # gate at least fp32 (here the inputs' float64), 1/sqrt(K), L2 norm in-kernel, int64 boundaries
    assert flash_qla_stand_in == [(torch.float64, torch.float64, 16 ** -0.5, True, (torch.int64, cu))]
