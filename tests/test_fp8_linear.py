"""`fastqwen_fp8` on CPU: the quantization, the frozen FP8 linear, and a LoRA model patched with it.

`torch._scaled_mm` with row-wise scales runs on the CPU in the torch versions of every CI cell, so
the op and the patch are exercised here exactly as on the GPU except for the Triton quantization
kernel and cuBLAS (tests/test_gpu_kernels.py checks those against these references).

References and tolerances:
* the quantization against its definition: every value within half an e4m3 step of its row's
  scale (e4m3 has 3 mantissa bits: relative step 2^-3, so |error| <= 2^-4 of the value, plus
  the subnormal floor), scales exactly amax / 448;
* the GEMMs against the exact product of the dequantized operands (fp64): the only further error is
  the bf16 rounding of the output (2^-8 relative per element: 1e-2 on the norm is generous), and
  against the fp32 product of the unquantized operands: 3.7% measured for Gaussian operands, bound
  `fp8_decision.TOLERANCE` (6%);
* the patched model against the same model unpatched in fp32: FP8 rounding in every projection of
  every layer, bounded as stated at each assert (measured, then doubled);
* `unpatch_model`: bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from axolotl_fastqwen import patch_model, unpatch_model
from axolotl_fastqwen.kernel_choice import fp8_decision
from axolotl_fastqwen.ops.fp8_linear import Fp8Weight, InputCache, bf16_linear_reference, fp8_linear
from axolotl_fastqwen.ops import fp8_quantize
from axolotl_fastqwen.ops.fp8_quantize import E4M3, E4M3_MAX, quantize_blocks_reference, quantize_rows_reference
from axolotl_fastqwen.patching import fp8_weights
from test_lean_activations import lora_model
from test_patching import packed_batch, sequences


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


# ---- the quantization ------------------------------------------------------------------------
def test_row_quantization_is_within_half_an_e4m3_step_and_pads_to_the_gemm_grid():
    torch.manual_seed(0)
    x = torch.randn(37, 96) * torch.logspace(-3, 2, 37)[:, None]  # rows of very different magnitudes
    x[5] = 0.0  # an all-zero row (a padded token)
    q, scale = quantize_rows_reference(x)
    assert q.dtype == E4M3 and q.shape == (48, 96) and scale.shape == (48, 1)  # 37 rows -> 48 (16-aligned)
    assert torch.equal(q[37:].float(), torch.zeros(11, 96)) and torch.equal(scale[37:], torch.ones(11, 1))
    amax = x.abs().amax(1, keepdim=True)
    assert torch.allclose(scale[:37][amax > 0], (amax / E4M3_MAX)[amax > 0], rtol=1e-6)
    assert scale[5].item() == 1.0 and q[5].float().abs().max() == 0
    back = q[:37].float() * scale[:37]
    floor = scale[:37] * 2.0 ** -9  # e4m3's smallest subnormal step, in each row's units
    assert ((back - x).abs() <= x.abs() * 2.0 ** -4 + floor).all()
    assert q.float().abs().amax(1)[:37][amax[:, 0] > 0].eq(E4M3_MAX).all()  # each row's peak lands on 448


def test_a_column_factor_is_applied_before_the_rows_scale():
    torch.manual_seed(1)
    x, c = torch.randn(20, 64), torch.rand(64) + 0.1
    q1, s1 = quantize_rows_reference(x, col_scale=c)
    q2, s2 = quantize_rows_reference(x * c)
    assert torch.equal(q1.float(), q2.float()) and torch.equal(s1, s2)


def test_block_quantization_scales_each_1x128_block_on_its_own_in_the_gemms_layout():
    torch.manual_seed(6)
    x = torch.randn(21, 384)
    x[3, 300] = 1e5  # an outlier channel in row 3's third block
    x[7] = 0.0
    q, scale = quantize_blocks_reference(x)
    assert q.shape == (32, 384) and scale.shape == (32, 3) and scale.stride() == (1, 32)  # outer-dim-major
    assert torch.equal(scale[21:], torch.ones(11, 3)) and torch.equal(q[21:].float(), torch.zeros(11, 384))
    amax = x.reshape(21, 3, 128).abs().amax(2)
    assert torch.allclose(scale[:21][amax > 0], (amax / E4M3_MAX)[amax > 0], rtol=1e-6)
    back = q[:21].float() * scale[:21].repeat_interleave(128, dim=1)
    floor = scale[:21].repeat_interleave(128, dim=1) * 2.0 ** -9
    assert ((back - x).abs() <= x.abs() * 2.0 ** -4 + floor).all()
    # the outlier costs only its own block: the row's other blocks keep e4m3's full precision, where
    # one scale per row pushes them into the subnormals (what `fp8-1x128` is for)
    rq, rs = quantize_rows_reference(x)
    rows_back = rq[:21].float() * rs[:21]
    clean = slice(0, 256)
    assert rel(back[3, clean], x[3, clean]) <= 0.04 < 0.1 <= rel(rows_back[3, clean], x[3, clean])
    with pytest.raises(ValueError, match="multiple of 128"):
        quantize_blocks_reference(torch.randn(4, 200))


def test_a_column_factor_is_applied_before_the_block_scales():
    torch.manual_seed(7)
    x, c = torch.randn(20, 256), torch.rand(256) + 0.1
    q1, s1 = quantize_blocks_reference(x, col_scale=c)
    q2, s2 = quantize_blocks_reference(x * c)
    assert torch.equal(q1.float(), q2.float()) and torch.equal(s1, s2)


# ---- the frozen FP8 linear -------------------------------------------------------------------
@pytest.mark.parametrize("keep_transposed", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_is_the_exact_product_of_its_quantized_operands(keep_transposed, dtype):
    torch.manual_seed(2)
    w = (torch.randn(80, 48) / 48 ** 0.5).to(dtype)
    x = torch.randn(3, 7, 48).to(dtype).requires_grad_(True)  # 21 tokens: padded to 32 inside
    dy = torch.randn(3, 7, 80).to(dtype)
    fp8 = Fp8Weight.quantize(w, keep_transposed=keep_transposed)
    y = fp8_linear(x, fp8)
    y.backward(dy)
    assert y.dtype == dtype and y.shape == (3, 7, 80) and x.grad.shape == x.shape

    wq = fp8.data.double() * fp8.scale.double().reshape(-1, 1)  # W as the GEMMs see it
    xq, sx = quantize_rows_reference(x.detach().reshape(21, 48))
    exact_y = (xq[:21].double() * sx[:21].double()) @ wq.t()
    assert rel(y.detach().reshape(21, 80), exact_y) <= 1e-2
    # dx = dy·W with W's per-channel scale folded into dy before dy's row quantization
    dq, sd = quantize_rows_reference(dy.reshape(21, 80), col_scale=fp8.scale.reshape(-1))
    exact_dx = (dq[:21].double() * sd[:21].double()) @ fp8.data.double()
    assert rel(x.grad.reshape(21, 48), exact_dx) <= 1e-2
    # and against the unquantized fp32 product: FP8's own rounding
    assert rel(y.detach(), bf16_linear_reference(x.detach(), w)) <= fp8_decision.TOLERANCE
    assert rel(x.grad, dy.float() @ w.float()) <= fp8_decision.TOLERANCE


def test_the_bf16_input_gradient_is_dy_times_the_dequantized_weight():
    """`input_gradient="bf16"` (FP8 forward only): dy is not quantized, the weight's own rounding stays."""
    torch.manual_seed(5)
    w = (torch.randn(80, 48) / 48 ** 0.5).to(torch.bfloat16)
    x = torch.randn(21, 48, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(21, 80, dtype=torch.bfloat16)
    fp8 = Fp8Weight.quantize(w)
    fp8_linear(x, fp8, input_gradient="bf16").backward(dy)
    assert rel(x.grad, dy.double() @ (fp8.data.double() * fp8.scale.double().reshape(-1, 1))) <= 1e-2
    with pytest.raises(ValueError, match="one of"):
        fp8_linear(x, fp8, input_gradient="fp16")
    with pytest.raises(ValueError, match="multiple of 128"):  # 80 output channels: no 1x128 blocks
        fp8_linear(x, fp8, input_gradient="fp8-1x128").backward(dy)


def test_the_block_scaled_input_gradient_keeps_an_outlier_channel_from_costing_its_row():
    """`input_gradient="fp8-1x128"`: the forward is the row-wise one; dx against the fp32 product of the
    unquantized operands. With one output channel 10^4 above the rest of dy (an outlier), per-token
    scales push the rest of each row into e4m3's subnormals and 1x128 blocks do not (errors measured
    below)."""
    torch.manual_seed(8)
    w = (torch.randn(256, 96) / 96 ** 0.5).to(torch.bfloat16)
    x = torch.randn(21, 96, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(21, 256, dtype=torch.bfloat16)
    fp8 = Fp8Weight.quantize(w)
    y = fp8_linear(x, fp8, input_gradient="fp8-1x128")
    assert torch.equal(y, fp8_linear(x, fp8))
    y.backward(dy)
    dq, sd = quantize_blocks_reference(dy, col_scale=fp8.scale.reshape(-1))
    exact = (dq[:21].double() * sd[:21].double().repeat_interleave(128, dim=1)) @ fp8.data.double()
    assert rel(x.grad, exact) <= 1e-2
    assert rel(x.grad, dy.float() @ w.float()) <= fp8_decision.TOLERANCE

    # an outlier channel (200) whose weight row is zero and whose block (128-255) is otherwise empty:
    # the true dx is the product of the first block alone, which the outlier can only spoil through
    # the scale it sets
    w0 = w.clone()
    w0[200] = 0
    fp8_0 = Fp8Weight.quantize(w0)
    spiky = dy.clone()
    spiky[:, 128:] = 0
    spiky[:, 200] = 1e4
    errors = {}
    for how in ("fp8", "fp8-1x128"):
        xs = x.detach().clone().requires_grad_(True)
        fp8_linear(xs, fp8_0, input_gradient=how).backward(spiky)
        errors[how] = rel(xs.grad, spiky.float() @ w0.float())
    assert errors["fp8-1x128"] <= fp8_decision.TOLERANCE < errors["fp8"], errors


def test_fp8_linear_gives_no_gradient_to_the_weight_or_bias_and_adds_the_bias():
    torch.manual_seed(3)
    w, b = torch.randn(32, 32), torch.randn(32)
    x = torch.randn(16, 32, requires_grad=True)
    fp8 = Fp8Weight.quantize(w)
    y = fp8_linear(x, fp8, b)
    assert rel(y.detach() - b, fp8_linear(x, fp8).detach()) <= 1e-6
    y.sum().backward()
    assert x.grad is not None and not fp8.data.requires_grad and fp8.data.grad is None


def test_projections_sharing_an_input_quantize_it_once(monkeypatch):
    calls = []
    real = fp8_quantize.quantize_rows
    monkeypatch.setattr("axolotl_fastqwen.ops.fp8_linear.quantize_rows",
                        lambda x, *a, **k: calls.append(x.shape) or real(x, *a, **k))
    torch.manual_seed(4)
    cache = InputCache()
    x = torch.randn(16, 32)
    gate, up = Fp8Weight.quantize(torch.randn(64, 32)), Fp8Weight.quantize(torch.randn(64, 32))
    a, b = fp8_linear(x, gate, cache=cache), fp8_linear(x, up, cache=cache)
    assert len(calls) == 1
    assert torch.equal(a, fp8_linear(x, gate))  # the cached quantization is the same quantization
    x.mul_(2.0)  # modified in place: a new version, quantized again
    assert torch.allclose(fp8_linear(x, up, cache=cache), 2 * b, rtol=1e-2)
    assert len(calls) == 3
    fp8_linear(x.clone(), up, cache=cache)  # another tensor with the same values: quantized again
    assert len(calls) == 4


# ---- a LoRA model patched with it ---------------------------------------------------------------
@pytest.fixture
def small_projections(monkeypatch):
    """The toy model's projections are 64-256 wide: let them count as large enough for FP8."""
    monkeypatch.setattr(fp8_weights, "MIN_FEATURES", 64)


class ProjectionCalls:
    """Each projection's input, output, output gradient and input gradient of one forward/backward."""

    def __init__(self, modules):
        self.modules, self.seen, self.handles = modules, {}, []

    def __enter__(self):
        for name, module in self.modules.items():
            def forward(m, args, out, name=name):
                self.seen[name] = [args[0], out.detach()]

            def backward(m, grad_in, grad_out, name=name):
                self.seen[name] += [grad_out[0].detach(), grad_in[0].detach()]

            self.handles += [module.register_forward_hook(forward), module.register_full_backward_hook(backward)]
        return self

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()


def loss_and_lora_grads(model, batch):
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_a_lora_model_trains_on_fp8_projections_close_to_fp32_and_unpatches_bit_for_bit(family, small_projections):
    model = lora_model(family, gc=False)
    seqs = sequences(model.config.vocab_size, [40, 31, 57])
    batch = packed_batch(seqs)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    patch_model(model, fused_cross_entropy=False, log=False)
    ref_loss, ref_grads = loss_and_lora_grads(model, batch)  # the plugin's fp32 path, no FP8
    unpatch_model(model)

    # peft's forward: the projections' hooks below see each base layer called (the fused LoRA reads the
    # base weights without calling the module; tests/test_fused_lora.py checks it runs the same FP8 GEMMs)
    report = patch_model(model, fused_cross_entropy=False, fp8=True, fp8_tokens=256, fused_lora=False, log=False)
    fp8 = report.to_dict()["fp8"]
    base = model.get_base_model()
    frozen = fp8_weights.candidates([base.model])
    assert fp8["modules_fp8"] == len(frozen) > 0
    for name, module in frozen.items():
        assert module.weight.dtype == E4M3 and not module.weight.requires_grad, name
        assert name.endswith(("base_layer", "in_proj_b", "in_proj_a")) is not name.endswith(("in_proj_b", "in_proj_a"))
    roles = fp8["projections"]
    assert {"mlp.gate_proj", "linear_attn.in_proj_qkv", "self_attn.o_proj"} <= set(roles) if family == "qwen3_5" \
        else {"linear_attn.out_proj", "self_attn.q_proj"} <= set(roles)
    assert all(r["fp8"] and r["selfcheck_error"] <= fp8_decision.TOLERANCE for r in roles.values())
    assert fp8["fp8_bytes"] < fp8["bf16_bytes_freed"] / 3  # fp32 toy weights: 4 bytes -> 1 (+ scales)
    assert "fp8 frozen GEMMs" in report.format() and "linear_attn.in_proj_qkv" in report.format()

    with ProjectionCalls(frozen) as calls:
        loss, grads = loss_and_lora_grads(model, batch)
    # Every projection, at its real inputs in this model: the exact product of the quantized operands
    # (catches a wrong weight, a stale shared input, a mis-wired backward).
    assert set(calls.seen) == set(frozen)
    for name, seen in calls.seen.items():
        if len(seen) == 2:  # no backward: an input that needs no gradient (the first layer's, from frozen embeddings)
            assert name.startswith("layers.0.") and not seen[0].requires_grad, name
            continue
        x, y, dy, dx = seen
        w = frozen[name]
        fp8_w = Fp8Weight(w.weight, w.fastqwen_fp8_scale)
        wq = fp8_w.data.double() * fp8_w.scale.double().reshape(-1, 1)
        xq, sx = quantize_rows_reference(x.detach().reshape(-1, x.shape[-1]))
        assert rel(y.reshape(-1, y.shape[-1]), (xq.double() * sx.double())[:y.numel() // y.shape[-1]] @ wq.t()) <= 1e-2
        dq, sd = quantize_rows_reference(dy.reshape(-1, dy.shape[-1]), col_scale=fp8_w.scale.reshape(-1))
        exact_dx = (dq.double() * sd.double())[:dx.numel() // dx.shape[-1]] @ fp8_w.data.double()
        assert rel(dx.reshape(-1, dx.shape[-1]), exact_dx) <= 1e-2, name
    # The model as a whole against fp32: the loss is well conditioned (measured 0.17% apart; bound 2%).
    # Its LoRA gradients are not, at toy size with random weights: bf16 autocast alone moves them 19%
    # (cosine 0.98) and e4m3, 32x coarser, ~100% (cosine 0.6); the GPU test and the 300-step loss
    # comparison judge FP8's accuracy at real shapes. Here: every LoRA parameter gets a gradient.
    assert abs(float(loss - ref_loss)) <= 2e-2 * float(ref_loss)
    assert set(grads) == set(ref_grads) and all(g.abs().sum() > 0 for g in grads.values())

    held = [module.weight for module in frozen.values()]  # references that outlive the patch
    unpatch_model(model)
    for name, param in model.named_parameters():
        assert param.dtype == before[name].dtype and torch.equal(param.detach(), before[name]), name
    # each e4m3 copy was freed before its bf16 weight came back, references or not: a restore that held
    # both ran out of memory on an H100 at 32k-token rows
    assert all(w.dtype == E4M3 and w.untyped_storage().size() == 0 for w in held)
    patch_model(model, fused_cross_entropy=False, log=False)
    assert torch.equal(loss_and_lora_grads(model, batch)[0], ref_loss)


def test_fp8_under_gradient_checkpointing_gives_the_gradients_of_the_run_without(small_projections):
    batch = packed_batch(sequences(512, [40, 31, 57]))
    results = []
    for gc in (False, True):
        model = lora_model("qwen3_5", gc=gc)
        patch_model(model, fused_cross_entropy=False, fp8=True, fp8_tokens=256, log=False)
        results.append(loss_and_lora_grads(model, batch))
    (l0, g0), (l1, g1) = results
    assert torch.equal(l0, l1)
    assert all(torch.equal(g0[n], g1[n]) for n in g0)  # the recompute quantizes the same inputs the same way


def test_fp8_before_lora_is_refused_with_what_to_do(small_projections):
    from test_patching import model_for

    model = model_for("qwen3_5")  # nothing frozen: full fine-tuning, or LoRA not applied yet
    with pytest.raises(ValueError, match="no frozen projection .* LoRA applied"):
        patch_model(model, fp8=True, log=False)
    assert not any(p.dtype == E4M3 for p in model.parameters())


def test_a_cast_after_quantization_raises_instead_of_training_on_meaningless_weights(small_projections):
    model = lora_model("qwen3_5", gc=False)
    patch_model(model, fused_cross_entropy=False, fp8=True, fp8_tokens=256, log=False)
    model.to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="e4m3 weight was cast to torch.bfloat16"):
        model(**packed_batch(sequences(512, [40])))


def test_a_shape_whose_self_check_fails_stays_bf16_and_the_report_says_why(small_projections, monkeypatch):
    real = fp8_decision.fp8_linear

    def broken(x, weight, *a, **k):  # a miscompiled kernel: right shape, wrong values
        y = real(x, weight, *a, **k)
        return y * (2.0 if weight.data.shape == (128, 64) else 1.0)

    monkeypatch.setattr(fp8_decision, "fp8_linear", broken)
    model = lora_model("qwen3_5", gc=False)
    report = patch_model(model, fused_cross_entropy=False, fp8=True, fp8_tokens=256, log=False).to_dict()["fp8"]
    rows = report["projections"]
    for role in ("linear_attn.in_proj_qkv", "mlp.gate_proj", "mlp.up_proj"):  # the [128, 64] weights
        assert not rows[role]["fp8"] and rows[role]["why"].startswith("self-check failed: relative error")
    assert rows["mlp.down_proj"]["fp8"]
    assert model.get_base_model().model.layers[0].mlp.gate_proj.base_layer.weight.dtype == torch.float32


# ---- the Triton kernels, in Triton's interpreter ------------------------------------------------
INTERPRETED = r"""
import torch
from axolotl_fastqwen.ops.fp8_quantize import (quantize_blocks_reference, quantize_blocks_triton,
                                               quantize_rows_reference, quantize_rows_triton)
from axolotl_fastqwen.ops.fp8_transpose import transpose_triton

torch.manual_seed(0)
w = torch.randn(130, 77).to(torch.float8_e4m3fn)  # tiles cut at both edges
assert torch.equal(transpose_triton(w).view(torch.uint8), w.t().contiguous().view(torch.uint8))
stack = torch.randn(3, 130, 77).to(torch.float8_e4m3fn)  # the routed experts' stack: one matrix per z
assert torch.equal(transpose_triton(stack).view(torch.uint8), stack.transpose(1, 2).contiguous().view(torch.uint8))
x = (torch.randn(37, 300) * 3).to(torch.bfloat16)
x[5] = 0
col = torch.rand(300) + 0.5
for c in (None, col):
    q, s = quantize_rows_triton(x, col_scale=c)
    qr, sr = quantize_rows_reference(x, col_scale=c)
    assert q.shape == qr.shape == (48, 300) and torch.equal(s, sr), (s - sr).abs().max()
    assert torch.equal(q[37:].float(), qr[37:].float())
groups = torch.tensor([2, 0, 1] * 12 + [2])  # each row scaled by its own group's column factors
cols = torch.rand(3, 300) + 0.5
q, s = quantize_rows_triton(x, col_scale=cols, groups=groups)
qr, sr = quantize_rows_reference(x, col_scale=cols, groups=groups)
assert q.shape == qr.shape == (37, 300) and torch.equal(s, sr), (s - sr).abs().max()
xb = (torch.randn(37, 1280) * 3).to(torch.bfloat16)  # 10 blocks: one full group of 8 and a cut one
xb[5] = 0
xb[9, 1100] = 1e4
colb = torch.rand(1280) + 0.5
for c in (None, colb):
    q, s = quantize_blocks_triton(xb, col_scale=c)
    qr, sr = quantize_blocks_reference(xb, col_scale=c)
    assert q.shape == qr.shape == (48, 1280) and s.stride() == sr.stride() == (1, 48)
    assert torch.equal(s, sr), (s - sr).abs().max()
    assert torch.equal(q[37:].float(), qr[37:].float())
print("ok")
"""


def test_the_triton_kernels_index_mask_and_scale_like_their_references_in_the_interpreter():
    """The kernels' indexing, masking, padding and scales on the CPU, in Triton's interpreter
    (`TRITON_INTERPRET=1`): the transposition bit for bit, the quantization's scales exactly. The
    interpreter's own float -> e4m3 cast rounds differently from the GPU's (it sends 124.3 to 64), so
    the quantized values are compared on the GPU (tests/test_gpu_kernels.py), not here."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", INTERPRETED], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_block_scaled_input_gradients_take_the_shapes_they_fit_and_the_report_names_the_mode(small_projections):
    """`fp8_input_gradient="fp8-1x128"` on the toy LoRA model: a weight whose output channels are not a
    multiple of 128 cannot have 1x128 blocks of `dy`, so its self-check raises and it stays bf16 with the
    reason; the others run FP8 and the model trains; the report says how the input gradients run."""
    model = lora_model("qwen3_5", gc=False)
    batch = packed_batch(sequences(512, [40, 31, 57]))
    report = patch_model(model, fused_cross_entropy=False, fp8=True, fp8_tokens=256, fp8_input_gradient="fp8-1x128",
                         log=False)
    fp8 = report.to_dict()["fp8"]
    assert fp8["input_gradient"] == "fp8-1x128" and "output gradients per 1x128 block" in report.format()
    rows = fp8["projections"].values()
    assert all(r["fp8"] == (r["shape"][0] % 128 == 0) for r in rows), fp8["projections"]
    assert any(r["fp8"] for r in rows) and any(not r["fp8"] for r in rows)
    assert all("multiple of 128" in r["why"] for r in rows if not r["fp8"])
    loss, grads = loss_and_lora_grads(model, batch)
    assert torch.isfinite(loss) and all(g.abs().sum() > 0 for g in grads.values())
    unpatch_model(model)
    report = patch_model(model, fused_cross_entropy=False, fp8=True, fp8_tokens=256, fp8_input_gradient="bf16",
                         log=False)
    assert "input gradients in bf16 on the dequantized weights" in report.format()
