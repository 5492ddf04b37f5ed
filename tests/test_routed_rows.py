"""The routed experts' row kernels, as `fastqwen_grouped` runs them on a GPU: the gate with its routing
weight in one kernel each way (`ops/routed_swiglu.py`) and each token's k rows summed in one kernel
(`ops/routed_combine.py`, forward and in the input's gradient); and how the experts self-check treats them.

References: the fp64 autograd of transformers' own formula (`act_fn(gate) * up`, then the routing
weight) and the fp64 gather-and-sum for the kernels, and transformers' eager experts loop in fp32
for the whole experts module.
The Triton kernels run here in Triton's interpreter (`TRITON_INTERPRET=1`, a subprocess); on the GPU
in tests/test_gpu_kernels.py at the 35B-A3B's shapes.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from axolotl_fastqwen import patch_model, unpatch_model
from axolotl_fastqwen.kernel_choice import experts_selfcheck as experts_check
from axolotl_fastqwen.kernel_choice.selfcheck import TOLERANCE
from axolotl_fastqwen.layers import grouped_experts
from axolotl_fastqwen.layers.experts_implementation import experts_modules
from axolotl_fastqwen.ops.routed_combine import routed_combine_torch, shared_term_backward_torch
from axolotl_fastqwen.ops.routed_swiglu import routed_swiglu_reference
from tiny_assets import build_tiny_model

pytest.importorskip("transformers.integrations.moe")

# fp32 kernels against fp64: round-off of a few fp32 ops per element (measured 1.2e-7); bf16 inputs and
# outputs, the truth computed from the same bf16 inputs: one bf16 rounding of each result, at most
# bf16's unit round-off 2^-8 = 3.9e-3 relative per element, so the norm ratio is below it (measured 3.2e-3)
FP32_TOL, BF16_TOL = 1e-5, 2 ** -8

INTERPRETED = r"""
import torch, torch.nn.functional as F
from axolotl_fastqwen.ops.routed_swiglu import routed_swiglu_triton

def rel(a, b):
    return float((a.double() - b).norm() / b.norm().clamp_min(1e-30))

torch.manual_seed(0)
worst = {}
# rows not a multiple of the 8-row block, I past one 256-column block (the backward's loop and the
# masks), a strided [gate | up] (a column slice of a wider tensor), no rows at all, bf16
for rows, inter, dtype, wide in [(37, 300, torch.float32, False), (9, 64, torch.float32, True),
                                 (0, 64, torch.float32, False), (21, 300, torch.bfloat16, False)]:
    base = torch.randn(rows, 2 * inter + (5 if wide else 0)) * 2
    gu = base[:, :2 * inter].to(dtype)
    w = torch.rand(rows).to(dtype)
    dy = torch.randn(rows, inter).to(dtype)
    g64, w64 = gu.double().requires_grad_(True), w.double().requires_grad_(True)
    gate, up = g64.chunk(2, dim=-1)
    truth = F.silu(gate) * up * w64.unsqueeze(-1)  # transformers' gate, then the weight, in fp64
    truth.backward(dy.double())
    x, ww = gu.clone().requires_grad_(True), w.clone().requires_grad_(True)
    if wide:
        x = base[:, :2 * inter].clone().requires_grad_(True)
        x_in = torch.cat([x, torch.zeros(rows, 5)], dim=1)[:, :2 * inter]  # stride 2I+5, unit column stride
        assert x_in.stride(0) == 2 * inter + 5
    else:
        x_in = x
    out = routed_swiglu_triton(x_in, ww)
    assert out.dtype == dtype and out.shape == (rows, inter)
    out.backward(dy)
    if rows == 0:
        assert x.grad.shape == x.shape and ww.grad.shape == (0,)
        continue
    errs = [rel(out, truth.detach()), rel(x.grad, g64.grad), rel(ww.grad, w64.grad)]
    worst[str(dtype)] = max(worst.get(str(dtype), 0.0), *errs)
print(worst)
print("ok")
"""

COMBINE_INTERPRETED = r"""
import torch
from axolotl_fastqwen.ops.routed_combine import routed_combine_triton, shared_term_backward_triton

def rel(a, b):
    return float((a.double() - b).norm() / b.norm().clamp_min(1e-30))

torch.manual_seed(0)
worst = {}
# H past one 512-column block (masks; the shared term's backward loops over them), k = 3 and 8, with and
# without the second source and the shared expert's term, no tokens, bf16
for tokens, k, cols, dtype, extra, shared in [
        (13, 3, 700, torch.float32, False, False), (5, 8, 64, torch.float32, True, True),
        (0, 3, 64, torch.float32, False, True), (11, 3, 700, torch.bfloat16, True, False),
        (9, 3, 1100, torch.float32, False, True), (11, 3, 700, torch.bfloat16, True, True)]:
    src = torch.randn(tokens * k, cols).to(dtype)
    more = torch.randn(tokens * k, cols).to(dtype) if extra else None
    unsort = torch.randperm(tokens * k)
    rows = src.double()[unsort] + (more.double()[unsort] if extra else 0)
    truth = rows.view(tokens, k, cols).sum(dim=1)
    term = ()
    if shared:  # the sparse block's `sigmoid(gate)·shared` and its gradients, by fp64 autograd
        sh, gate = torch.randn(tokens, cols).to(dtype), (2 * torch.randn(tokens, 1)).to(dtype)
        sh64, gate64 = sh.double().requires_grad_(True), gate.double().requires_grad_(True)
        added = torch.sigmoid(gate64) * sh64
        dy = torch.randn(tokens, cols).to(dtype)
        added.backward(dy.double())
        truth = truth + added.detach()
        term = (sh, gate)
    out = routed_combine_triton(src, unsort, k, more, *term)
    assert out.dtype == dtype and out.shape == (tokens, cols)
    errs = [rel(out, truth)] if tokens else []
    if shared:
        d_sh, d_gate = shared_term_backward_triton(dy, sh, gate)
        assert d_sh.dtype == dtype and d_sh.shape == sh.shape and d_gate.dtype == dtype and d_gate.shape == gate.shape
        errs += [rel(d_sh, sh64.grad), rel(d_gate, gate64.grad)] if tokens else []
    if errs:
        worst[str(dtype)] = max(worst.get(str(dtype), 0.0), *errs)
print(worst)
print("ok")
"""

WHOLE_EXPERTS = r"""
import torch
from axolotl_fastqwen.kernel_choice.experts_selfcheck import compare
from axolotl_fastqwen.layers import grouped_experts
from axolotl_fastqwen.layers.experts_implementation import experts_modules
from axolotl_fastqwen.layers.grouped_experts import GROUPED, register
from tiny_assets import build_tiny_model

calls = {"swiglu": 0, "combine": 0, "shared": 0}
swiglu, combine = grouped_experts.routed_swiglu_triton, grouped_experts.routed_combine_triton
shared_backward = grouped_experts.shared_term_backward_triton

def counted_swiglu(*args):
    calls["swiglu"] += 1
    return swiglu(*args)

def counted_combine(*args):
    calls["combine"] += 1
    return combine(*args)

def counted_shared(*args):
    calls["shared"] += 1
    return shared_backward(*args)

grouped_experts.routed_swiglu_triton, grouped_experts.routed_combine_triton = counted_swiglu, counted_combine
grouped_experts.shared_term_backward_triton = counted_shared
grouped_experts.routed_kernels = lambda module, rows: "triton"  # the GPU's choice, on this CPU
register()
for family in ("qwen3_5_moe", "qwen3_next", "gelu"):
    module = experts_modules(build_tiny_model("qwen3_5_moe" if family == "gelu" else family))[0]
    if family == "gelu":  # another gate: the module's own _apply_gate, the Triton sums still (the check's
        module.config.hidden_act = "gelu"  # copy of the module is built from its config)
        module.act_fn = torch.nn.GELU()
        assert not grouped_experts.silu_gate(module)
    before = dict(calls)
    top_k = module.config.num_experts_per_tok
    errs = [compare(module, GROUPED, top_k, torch.float32), compare(module, GROUPED, top_k, torch.float32, lora_rank=16),
            compare(module, GROUPED, top_k, torch.float32, shared=True)]
    print(family, errs, calls)
    assert max(errs) <= 1e-5, (family, errs)
    # per compare: the routed rows' sum forward and in backward; the gate (SiLU only) once; the shared
    # expert's term's gradients once, where it is passed
    assert calls["combine"] - before["combine"] == 6, calls
    assert calls["swiglu"] - before["swiglu"] == (0 if family == "gelu" else 3), calls
    assert calls["shared"] - before["shared"] == 1, calls
print("ok")
"""


def _interpreted(script: str) -> str:
    pytest.importorskip("triton")
    tools = str(Path(__file__).resolve().parent.parent / "tools")  # tiny_assets, as conftest.py adds it
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (tools, os.environ.get("PYTHONPATH")) if p)}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout[-2000:] + done.stderr[-3000:]
    return done.stdout


def test_the_kernels_give_transformers_gate_times_the_weight_and_its_gradients_in_the_interpreter():
    """Forward, d[gate | up] and dw against fp64 autograd; odd sizes, a strided input, no rows, bf16."""
    out = _interpreted(INTERPRETED)
    worst = eval(out.strip().splitlines()[-2])  # noqa: S307 - our own subprocess's dict of floats
    assert worst["torch.float32"] <= FP32_TOL and worst["torch.bfloat16"] <= BF16_TOL, worst


def test_the_combine_kernel_sums_each_token_s_rows_like_a_gather_and_sum_in_the_interpreter():
    """Against the fp64 gather-and-sum; two column blocks, k = 3 and 8, the second source, no tokens, bf16;
    with the shared expert's gated term, and its backward kernel against fp64 autograd (three column blocks)."""
    out = _interpreted(COMBINE_INTERPRETED)
    worst = eval(out.strip().splitlines()[-2])  # noqa: S307 - our own subprocess's dict of floats
    assert worst["torch.float32"] <= FP32_TOL and worst["torch.bfloat16"] <= BF16_TOL, worst


def test_fastqwen_grouped_with_the_kernels_matches_transformers_eager_experts_in_the_interpreter():
    """The whole experts module, forward and backward (hidden, routing weights, expert weights; and the
    factored LoRA's factors, the down projection's through the combine's second source; and with a sparse
    block's shared expert in the sum, against the block's own term), with the Triton kernels against
    transformers' eager loop in fp32; and with another gate, the combine kernels alone."""
    _interpreted(WHOLE_EXPERTS)


def test_the_reference_is_transformers_gate_then_the_weight():
    """The CPU path and the kernels' oracle: transformers' own `_apply_gate` on a real experts module,
    times the routing weight, within fp32 round-off."""
    module = experts_modules(build_tiny_model("qwen3_5_moe"))[0]
    gen = torch.Generator().manual_seed(3)
    gate_up = torch.randn(50, module.gate_up_proj.shape[1], generator=gen)
    w = torch.rand(50, generator=gen)
    stock = module._apply_gate(gate_up.double()) * w.double().unsqueeze(-1)
    assert grouped_experts.silu_gate(module)
    assert float((routed_swiglu_reference(gate_up, w).double() - stock).norm() / stock.norm()) <= FP32_TOL


def _triton_unless_pinned(module, rows):
    """What `routed_kernels` answers on a GPU with Triton, on this CPU."""
    return "torch" if module.__dict__.get(grouped_experts.ROUTED_KERNELS_ATTR) == "torch" else "triton"


def _broken(monkeypatch, kind):
    """One kernel 5% off (the others right): PyTorch's ops stand in for the kernels on this CPU."""
    swiglu = (lambda gu, w: routed_swiglu_reference(gu, w) * 1.05) if kind == "swiglu" else routed_swiglu_reference
    combine = ((lambda src, unsort, k, *more: routed_combine_torch(src, unsort, k, *more) * 1.05)
               if kind == "combine" else routed_combine_torch)
    shared = ((lambda *args: tuple(t * 1.05 for t in shared_term_backward_torch(*args)))
              if kind == "shared" else shared_term_backward_torch)
    monkeypatch.setattr(grouped_experts, "routed_kernels", _triton_unless_pinned)
    monkeypatch.setattr(experts_check, "routed_kernels", _triton_unless_pinned)
    monkeypatch.setattr(grouped_experts, "routed_swiglu_triton", swiglu)
    monkeypatch.setattr(grouped_experts, "routed_combine_triton", combine)
    monkeypatch.setattr(grouped_experts, "shared_term_backward_triton", shared)


@pytest.mark.parametrize("kind", ["swiglu", "combine", "shared"])
def test_a_failing_kernel_leaves_fastqwen_grouped_on_pytorch_s_ops_and_unpatch_clears_it(monkeypatch, kind):
    """Any kernel 5% off (the shared expert's backward included): the self-check rejects fastqwen_grouped with the Triton rows, passes it on
    PyTorch's ops, pins that on every experts module (the model keeps fastqwen_grouped, not
    transformers' grouped_mm), and the report says so; `unpatch_model` takes the pin off."""
    model = build_tiny_model("qwen3_5_moe")
    patch_model(model, fused_cross_entropy=False, log=False)
    _broken(monkeypatch, kind)
    check = experts_check.selfcheck_experts(model, torch.float32, devices=("cpu",))
    assert check.implementation == grouped_experts.GROUPED, check
    assert [name for name, _ in check.rejected] == [f"{grouped_experts.GROUPED} (routed rows: triton)"], check
    assert "> 2e-03" in check.rejected[0][1] and "routed rows: torch" in check.selfcheck
    modules = experts_modules(model)
    assert {m.__dict__.get(grouped_experts.ROUTED_KERNELS_ATTR) for m in modules} == {"torch"}
    assert "pinned" in grouped_experts.describe_routed_kernels(modules[0])
    unpatch_model(model)
    assert all(grouped_experts.ROUTED_KERNELS_ATTR not in m.__dict__ for m in modules)


def test_working_kernels_pass_the_experts_self_check_and_are_reported(monkeypatch):
    """The self-check's label and line name the row kernels; on a CPU the report says why they are
    PyTorch's ops."""
    model = build_tiny_model("qwen3_5_moe")
    report = patch_model(model, fused_cross_entropy=False, log=False)
    line = report.to_dict()["experts"]["routed_rows"]
    assert line.startswith("PyTorch's ops") and "(on cpu)" in line
    assert "routed rows: PyTorch's ops" in report.format()
    _broken(monkeypatch, None)  # all right
    check = experts_check.selfcheck_experts(model, torch.float32, devices=("cpu",))
    assert check.implementation == grouped_experts.GROUPED and not check.rejected, check
    assert "routed rows: triton" in check.selfcheck
    assert all(grouped_experts.ROUTED_KERNELS_ATTR not in m.__dict__ for m in experts_modules(model))
    unpatch_model(model)


def test_other_gates_keep_the_module_s_own(monkeypatch):
    """An experts class with its own `_apply_gate` or a non-SiLU activation has no fused gate (the
    interpreter test runs such a module through the combine kernel)."""
    module = experts_modules(build_tiny_model("qwen3_5_moe"))[0]
    assert grouped_experts.silu_gate(module)
    monkeypatch.setattr(module, "act_fn", torch.nn.GELU())
    assert not grouped_experts.silu_gate(module)
    assert grouped_experts.routed_kernels(module, torch.zeros(1, 2)) == "torch"  # a CPU tensor
