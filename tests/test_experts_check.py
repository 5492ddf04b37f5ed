"""The experts self-check (`kernel_choice/experts_selfcheck.py`) against transformers' own eager experts.

Run on a CPU here (`devices=("cpu",)`; in training it runs on the GPU only, like every kernel
check): a correct implementation passes at the fp32 tolerance, one that is wrong in its forward,
wrong only in its backward, or that raises is rejected and the model is moved to the next that
passes, through transformers' `set_experts_implementation`. GPU: tests/test_gpu_kernels.py.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from axolotl_fastqwen.layers.experts_implementation import experts_modules
from axolotl_fastqwen.kernel_choice.experts_selfcheck import CHECK_TOKENS, check_inputs, compare, selfcheck_experts
from axolotl_fastqwen.kernel_choice.selfcheck import TOLERANCE
from axolotl_fastqwen.layers.grouped_experts import GROUPED
from tiny_assets import build_tiny_model

moe = pytest.importorskip("transformers.integrations.moe")


def grouped(module, hidden, index, weights):
    return moe.ALL_EXPERTS_FUNCTIONS["grouped_mm"](module, hidden, index, weights)


def scaled_output(module, hidden, index, weights):
    """5% too large: a wrong forward."""
    return grouped(module, hidden, index, weights) * 1.05


class _WrongGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g * 1.1


def wrong_backward(module, hidden, index, weights):
    """Right values, gradients 10% off: only the backward is wrong."""
    return _WrongGrad.apply(grouped(module, hidden, index, weights))


def raises(module, hidden, index, weights):
    raise RuntimeError("no kernel image is available for execution on the device")


@contextlib.contextmanager
def registered(**fns):
    for name, fn in fns.items():
        moe.ALL_EXPERTS_FUNCTIONS[name] = fn
    try:
        yield
    finally:
        for name in fns:
            del moe.ALL_EXPERTS_FUNCTIONS[name]


def implementations(model) -> set:
    return {m.config._experts_implementation for m in experts_modules(model)}


@pytest.fixture
def model():
    model = build_tiny_model("qwen3_5_moe")
    yield model


def test_transformers_grouped_and_batched_experts_pass_against_eager(model):
    module = experts_modules(model)[0]
    top_k = module.config.num_experts_per_tok
    for impl in ("grouped_mm", "batched_mm"):
        err = compare(module, impl, top_k, torch.float32)
        assert err <= TOLERANCE[torch.float32], (impl, err)  # measured ~3e-7: same math, other order
    _, index, _ = check_inputs(module, top_k, torch.device("cpu"), experts=4)
    assert index.shape == (CHECK_TOKENS, top_k) and len(index.unique()) == 4  # every check expert gets tokens


@pytest.mark.parametrize("bad", [scaled_output, wrong_backward, raises], ids=lambda f: f.__name__)
def test_a_failing_implementation_is_replaced_by_the_next_that_passes(model, bad):
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with registered(fastqwen_test_bad=bad):
        model.set_experts_implementation("fastqwen_test_bad")
        check = selfcheck_experts(model, torch.float32, devices=("cpu",))
        # the first of FALLBACK_ORDER: the plugin's grouped experts (transformers' grouped_mm math)
        assert check.implementation == GROUPED and implementations(model) == {GROUPED}
        assert [name for name, _ in check.rejected] == ["fastqwen_test_bad"]
        why = check.rejected[0][1]
        assert ("raised RuntimeError" in why) if bad is raises else ("rel. error" in why and "> 2e-03" in why)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # the check ran on copies


def test_a_passing_implementation_is_kept_and_named(model):
    model.set_experts_implementation("batched_mm")
    check = selfcheck_experts(model, torch.float32, devices=("cpu",))
    assert check.implementation == "batched_mm" and implementations(model) == {"batched_mm"}
    assert check.rejected == [] and check.selfcheck.startswith("fwd+bwd rel. error")
    assert "4 experts, top-2" in check.selfcheck


def test_off_the_gpu_nothing_is_checked_and_dense_models_have_no_experts(model):
    check = selfcheck_experts(model, torch.float32)
    assert check.selfcheck == "not self-checked (cpu)" and check.implementation == "grouped_mm"
    assert selfcheck_experts(build_tiny_model("qwen3_5"), torch.float32, devices=("cpu",)) is None


def test_eager_is_the_reference_itself(model):
    model.set_experts_implementation("eager")
    check = selfcheck_experts(model, torch.float32, devices=("cpu",))
    assert check.implementation == "eager" and "reference itself" in check.selfcheck


def test_a_check_that_cannot_copy_the_module_keeps_the_implementation_and_says_so(model, monkeypatch):
    """A failure of the check's own set-up says nothing about the implementation: it is kept."""
    from axolotl_fastqwen.kernel_choice import experts_selfcheck as experts_check

    def cannot_copy(*args, **kwargs):
        raise TypeError("parametrized experts")

    monkeypatch.setattr(experts_check, "check_module", cannot_copy)
    check = selfcheck_experts(model, torch.float32, devices=("cpu",))
    assert check.implementation == "grouped_mm" and implementations(model) == {"grouped_mm"}
    assert check.selfcheck.startswith("not self-checked: the experts module could not be copied (TypeError")


@pytest.mark.parametrize("shape", ["qwen3.5-35b-a3b", "qwen3-next-80b-a3b"])
def test_the_check_runs_at_the_real_expert_sizes(shape):
    """What the doctor and the GPU test build: the family's experts class at the shape's hidden and
    intermediate sizes and top-k (16 experts here, to keep a CPU run small)."""
    from fastqwen_bench.shapes import build_experts, get_shape

    experts = build_experts(get_shape(shape), torch.device("cpu"), torch.float32, experts=16)
    assert experts.gate_up_proj.shape == (16, 1024, 2048) and experts.down_proj.shape == (16, 2048, 512)
    check = selfcheck_experts(experts, torch.float32, devices=("cpu",))
    top_k = {"qwen3.5-35b-a3b": 8, "qwen3-next-80b-a3b": 10}[shape]
    assert check.implementation == "grouped_mm" and f"16 experts, top-{top_k}" in check.selfcheck
    assert build_experts(get_shape("qwen3.5-27b"), torch.device("cpu"), torch.float32) is None


def test_fastqwen_grouped_is_checked_with_its_factored_lora_too(model, monkeypatch):
    """The plugin's experts pass plain and with LoRA factors (fp32 here: round-off); a factored path
    that ignores the adapter (right without LoRA, wrong with it) is rejected and the next in line,
    transformers' grouped_mm, trains."""
    from axolotl_fastqwen.kernel_choice import experts_selfcheck as experts_check
    from axolotl_fastqwen.layers.grouped_experts import register

    register()
    module = experts_modules(model)[0]
    top_k = module.config.num_experts_per_tok
    assert compare(module, GROUPED, top_k, torch.float32, lora_rank=16) <= TOLERANCE[torch.float32]
    model.set_experts_implementation(GROUPED)
    check = selfcheck_experts(model, torch.float32, devices=("cpu",))
    assert check.implementation == GROUPED and "shared expert, factored LoRA r=16" in check.selfcheck

    real = experts_check.grouped_experts_forward
    monkeypatch.setattr(experts_check, "grouped_experts_forward",  # drops the adapter
                        lambda m, x, i, w, lora=None, shared_expert=None: real(m, x, i, w, shared_expert=shared_expert))
    check = selfcheck_experts(model, torch.float32, devices=("cpu",))
    assert check.implementation == "grouped_mm" and implementations(model) == {"grouped_mm"}
    # on a CPU its routed rows run on PyTorch's ops (the Triton kernels are for GPUs): one try
    assert [name for name, _ in check.rejected] == [f"{GROUPED} (routed rows: torch)"]
    assert "rel. error" in check.rejected[0][1]


def test_fastqwen_grouped_is_checked_with_a_sparse_block_s_shared_expert(model, monkeypatch):
    """The shared expert's gated output its sparse blocks hand it is part of the check: a sum that
    leaves the gate out (right without the term, wrong with it) is rejected."""
    from axolotl_fastqwen.kernel_choice import experts_selfcheck as experts_check
    from axolotl_fastqwen.layers.grouped_experts import SharedExpert, register

    register()
    module = experts_modules(model)[0]
    top_k = module.config.num_experts_per_tok
    assert compare(module, GROUPED, top_k, torch.float32, shared=True) <= TOLERANCE[torch.float32]
    real = experts_check.grouped_experts_forward

    def ungated(m, x, i, w, lora=None, shared_expert=None):
        term = None if shared_expert is None else SharedExpert(shared_expert.output, torch.full_like(shared_expert.gate, 30.0))
        return real(m, x, i, w, lora=lora, shared_expert=term)  # sigmoid(30) = 1: the gate left out

    monkeypatch.setattr(experts_check, "grouped_experts_forward", ungated)
    model.set_experts_implementation(GROUPED)
    check = selfcheck_experts(model, torch.float32, devices=("cpu",))
    assert check.implementation == "grouped_mm", check
    assert "rel. error" in check.rejected[0][1]
