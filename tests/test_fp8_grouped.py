"""`fastqwen_fp8` on the routed experts: the FP8 grouped GEMMs (`ops/fp8_grouped.py`) and the stacks
quantized in a LoRA MoE model (`patching/fp8_weights.py`, `layers/grouped_experts.py`).

On the CPU, PyTorch has no scaled grouped GEMM: the op runs its stand-in (the same quantized operands,
dequantized, multiplied in fp32). What is proven here is everything around the GEMM, against
independent references: which rows get which expert's scales, the quantization's rows, the
transposed layout of the input gradient, the autograd wiring, the install, the report and the bit
for bit restore. CUTLASS's kernel itself is compared with the exact product of the quantized operands
on the GPU (tests/test_gpu_kernels.py, at the 35B-A3B's shapes).

Tolerances: against the exact product of the quantized operands, 1e-2 (the bf16 output's rounding,
2^-8 per element, and fp32 accumulation); against fp32, `fp8_decision.TOLERANCE` (6%: e4m3's 3
mantissa bits on both operands land at ~3.7% for Gaussian operands).
"""

from __future__ import annotations

import copy

import pytest
import torch

from axolotl_fastqwen import patch_model, unpatch_model
from axolotl_fastqwen.kernel_choice import fp8_decision
from axolotl_fastqwen.layers.experts_implementation import experts_modules
from axolotl_fastqwen.layers.grouped_experts import fp8_experts, grouped_experts_forward
from axolotl_fastqwen.ops.fp8_grouped import Fp8ExpertWeight, fp8_grouped_mm, grouped_reference
from axolotl_fastqwen.ops.fp8_quantize import E4M3, quantize_rows_reference
from axolotl_fastqwen.patching import fp8_weights
from test_grouped_experts import _batch, _lora_model, _routing

peft = pytest.importorskip("peft")


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def routed_rows(rows: int, experts: int, seed: int, empty: int | None = None):
    """(int32 offsets, each row's expert) of `rows` rows sorted by expert; expert `empty` gets none."""
    gen = torch.Generator().manual_seed(seed)
    groups = torch.randint(0, experts, (rows,), generator=gen)
    if empty is not None:
        groups[groups == empty] = (empty + 1) % experts
    groups = groups.sort().values
    return torch.cumsum(torch.bincount(groups, minlength=experts), 0).to(torch.int32), groups


def test_each_row_is_quantized_with_its_own_experts_column_scales():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(9, 32, generator=gen)
    cols = torch.rand(3, 32, generator=gen) + 0.5
    groups = torch.tensor([0, 0, 1, 1, 1, 2, 2, 2, 2])
    q, s = quantize_rows_reference(x, col_scale=cols, groups=groups)
    assert q.shape == (9, 32)  # grouped rows are not padded: the offsets cut them
    for row, g in enumerate(groups.tolist()):
        qr, sr = quantize_rows_reference(x[row:row + 1], col_scale=cols[g])
        assert torch.equal(q[row].float(), qr[0].float()) and torch.equal(s[row], sr[0])
    with pytest.raises(ValueError, match="one group id per row"):
        quantize_rows_reference(x, col_scale=cols[0], groups=groups)


@pytest.mark.parametrize("keep_transposed", [False, True])
def test_fp8_grouped_mm_is_the_exact_product_of_its_quantized_operands(keep_transposed):
    """Forward and input gradient, expert by expert, with an expert that gets no row."""
    experts, n, k, rows = 4, 48, 32, 37
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(experts, n, k, generator=gen) * (torch.rand(experts, n, 1, generator=gen) + 0.1)
    offsets, groups = routed_rows(rows, experts, seed=2, empty=2)
    assert offsets[2] == offsets[1]
    x = torch.randn(rows, k, generator=gen, requires_grad=True)
    dy = torch.randn(rows, n, generator=gen)
    fp8 = Fp8ExpertWeight.quantize(weight, keep_transposed=keep_transposed)
    assert fp8.data.dtype == E4M3 and fp8.scale.shape == (experts, n)
    assert (fp8.transposed is not None) is keep_transposed
    y = fp8_grouped_mm(x, fp8, offsets, groups)
    y.backward(dy)

    wq = fp8.data.double() * fp8.scale.double().unsqueeze(2)  # [E, N, K]
    xq, sx = quantize_rows_reference(x.detach(), rows_out=rows)
    dq, sd = quantize_rows_reference(dy, col_scale=fp8.scale, groups=groups)
    exact_y = grouped_reference(xq.double() * sx.double(), wq, offsets)
    # the weight's scales were folded into dy: the GEMM reads W_q as stored
    exact_dx = grouped_reference(dq.double() * sd.double(), fp8.data.double().transpose(1, 2), offsets)
    assert rel(y, exact_y) <= 1e-2 and rel(x.grad, exact_dx) <= 1e-2
    assert rel(y, grouped_reference(x.detach(), weight, offsets)) <= fp8_decision.TOLERANCE
    assert rel(x.grad, grouped_reference(dy, weight.transpose(1, 2), offsets)) <= fp8_decision.TOLERANCE


def test_the_bf16_input_gradient_is_dy_times_each_experts_dequantized_stack():
    experts, n, k, rows = 3, 32, 16, 20
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(experts, n, k, generator=gen)
    offsets, groups = routed_rows(rows, experts, seed=4)
    x = torch.randn(rows, k, generator=gen, requires_grad=True)
    dy = torch.randn(rows, n, generator=gen)
    fp8 = Fp8ExpertWeight.quantize(weight)
    fp8_grouped_mm(x, fp8, offsets, groups, input_gradient="bf16").backward(dy)
    exact = grouped_reference(dy, fp8.dequantized(torch.bfloat16).float().transpose(1, 2), offsets)
    assert rel(x.grad, exact) <= 1e-2
    with pytest.raises(ValueError, match="one of"):
        fp8_grouped_mm(x, fp8, offsets, groups, input_gradient="fp8-1x128")


def test_a_stack_is_quantized_per_expert_and_channel_in_chunks(monkeypatch):
    """Chunking over experts (the fp32 temporaries of a 35B-A3B stack would not fit beside the model)
    gives the stack quantized whole: the reference is each expert's rows quantized on their own."""
    from axolotl_fastqwen.ops import fp8_grouped

    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(5, 16, 32, generator=gen)
    weight[3, 7] = 0  # an all-zero channel: scale 1, zeros
    monkeypatch.setattr(fp8_grouped, "QUANTIZE_CHUNK", 2 * 16 * 32)  # two experts at a time, a short last chunk
    fp8 = Fp8ExpertWeight.quantize(weight)
    for e in range(5):
        q, s = quantize_rows_reference(weight[e], rows_out=16)
        assert torch.equal(fp8.data[e].float(), q.float()) and torch.equal(fp8.scale[e], s.reshape(-1))


# ---- a LoRA MoE model with its stacks in FP8 ------------------------------------------------------
@pytest.fixture
def small_projections(monkeypatch):
    monkeypatch.setattr(fp8_weights, "MIN_FEATURES", 64)


def _loss_and_grads(model, batch):
    model.zero_grad(set_to_none=True)
    out = model(**batch, output_router_logits=True)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_next"])
def test_the_routed_experts_train_on_fp8_stacks_with_expert_lora_and_unpatch_bit_for_bit(family, small_projections):
    model = _lora_model(family, rank=4)  # LoRA on the projections and on both expert stacks (target_parameters)
    batch = _batch(model.config.vocab_size)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    patch_model(model, fused_cross_entropy=False, log=False)
    ref_loss, ref_grads = _loss_and_grads(model, batch)  # the plugin in fp32, no FP8
    unpatch_model(model)

    report = patch_model(model, fused_cross_entropy=False, fp8=True, fp8_tokens=64, log=False)
    fp8 = report.to_dict()["fp8"]
    stacks = experts_modules(model)
    assert fp8["expert_stacks_fp8"] == 2 * len(stacks) > 0
    for module in stacks:
        assert fp8_experts(module).names == ("gate_up_proj", "down_proj") and fp8_experts(module).dtype == torch.float32
        assert module.gate_up_proj.dtype == module.down_proj.dtype == E4M3
    rows = fp8["projections"]
    assert rows["mlp.experts.gate_up_proj"]["fp8"] and rows["mlp.experts.down_proj"]["modules"] == len(stacks)
    assert all(r["selfcheck_error"] <= fp8_decision.TOLERANCE for r in rows.values() if r["fp8"])
    assert "routed-expert stacks" in report.format() and "mlp.experts.gate_up_proj" in report.format()

    # One experts module against transformers' eager loop in fp32, on the bf16 stacks it replaced: FP8's error
    module = stacks[0]
    experts, k = module.num_experts, module.config.num_experts_per_tok
    index, weights = _routing(48, experts, k, seed=6, skip=experts - 1)
    hidden = torch.randn(48, module.gate_up_proj.shape[-1], generator=torch.Generator().manual_seed(7))
    eager = copy.deepcopy(module)
    eager.config = copy.copy(eager.config)
    eager.config._experts_implementation = "eager"
    eager.__dict__.pop("_fastqwen_fp8_experts")
    for name in ("gate_up_proj", "down_proj"):
        host = report.fp8.host[next(q for q, (m, s) in report.fp8.stacks.items() if m is module and s == name)]
        setattr(eager, name, torch.nn.Parameter(host.clone(), requires_grad=False))
    with torch.no_grad():
        got, ref = grouped_experts_forward(module, hidden, index, weights), eager(hidden, index, weights)
    assert 1e-4 < rel(got, ref) <= fp8_decision.TOLERANCE  # FP8 ran (not bf16/fp32), and within its error

    loss, grads = _loss_and_grads(model, batch)
    assert abs(float(loss - ref_loss)) <= 2e-2 * float(ref_loss)  # measured 0.1-0.3% apart
    assert set(grads) == set(ref_grads) and all(g.abs().sum() > 0 for g in grads.values())
    assert any(".experts." in n and "lora_" in n for n in grads)  # the expert LoRA ran factored over FP8 stacks

    held = [getattr(m, n) for m in stacks for n in ("gate_up_proj", "down_proj")]
    unpatch_model(model)
    for name, param in model.named_parameters():
        assert param.dtype == before[name].dtype and torch.equal(param.detach(), before[name]), name
    assert all(w.untyped_storage().size() == 0 for w in held)  # the e4m3 stacks were freed
    assert all(fp8_experts(m) is None and not [b for b in m._buffers if "fp8" in b] for m in stacks)
    patch_model(model, fused_cross_entropy=False, log=False)
    assert torch.equal(_loss_and_grads(model, batch)[0], ref_loss)
    unpatch_model(model)


def test_experts_run_by_another_implementation_stay_bf16_and_the_report_says_why(small_projections):
    model = _lora_model("qwen3_5_moe", rank=4)
    model.base_model.model.set_experts_implementation("eager")  # the user's choice: the plugin leaves it
    report = patch_model(model, fused_cross_entropy=False, fp8=True, fp8_tokens=64, log=False)
    try:
        fp8 = report.to_dict()["fp8"]
        assert fp8["expert_stacks_fp8"] == 0 and fp8["modules_fp8"] > 0  # the projections still run FP8
        row = fp8["projections"]["mlp.experts.gate_up_proj"]
        assert not row["fp8"] and "'eager'" in row["why"]
        assert all(m.gate_up_proj.dtype == torch.float32 for m in experts_modules(model))
        _loss_and_grads(model, _batch(model.config.vocab_size))
    finally:
        unpatch_model(model)


def test_a_cast_stack_raises_instead_of_training_on_meaningless_values(small_projections):
    model = _lora_model("qwen3_5_moe", rank=4)
    patch_model(model, fused_cross_entropy=False, fp8=True, fp8_tokens=64, log=False)
    try:
        module = experts_modules(model)[0]
        module.gate_up_proj.data = module.gate_up_proj.data.float()
        with pytest.raises(RuntimeError, match="cast to torch.float32 after it was quantized"):
            model(**_batch(model.config.vocab_size))
    finally:
        unpatch_model(model)


def test_the_experts_self_check_reads_the_fp8_stacks_values_and_stops_if_grouped_fails(small_projections, monkeypatch):
    """The first-forward experts check copies the stacks it tests: from FP8 stacks, their dequantized
    values (not e4m3 codes read as numbers). If fastqwen_grouped fails it, a fallback implementation
    would read the e4m3 stacks as numbers: it stops with the reason instead."""
    from axolotl_fastqwen.kernel_choice import experts_selfcheck
    from axolotl_fastqwen.layers.grouped_experts import GROUPED

    model = _lora_model("qwen3_5_moe", rank=4)
    patch_model(model, fused_cross_entropy=False, fp8=True, fp8_tokens=64, log=False)
    try:
        base = model.get_base_model()
        module = experts_modules(base)[0]
        proxy = experts_selfcheck.check_module(module, GROUPED, torch.float32, torch.device("cpu"), experts=4)
        stack = fp8_experts(module).weight(module, "gate_up_proj")
        assert torch.equal(proxy.gate_up_proj.detach(), stack.dequantized(torch.float32))
        check = experts_selfcheck.selfcheck_experts(base, torch.float32, devices=("cpu",))
        assert check.implementation == GROUPED and "<=" in check.selfcheck

        def broken(module, name, *args, **kwargs):
            if name == GROUPED:
                raise RuntimeError("planted")
            return 0.0

        monkeypatch.setattr(experts_selfcheck, "compare", broken)
        with pytest.raises(RuntimeError, match="FP8 stacks need fastqwen_grouped.*planted"):
            experts_selfcheck.selfcheck_experts(base, torch.float32, devices=("cpu",))
    finally:
        unpatch_model(model)
