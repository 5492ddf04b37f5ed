"""Kernel selection and the self-check: nothing falls back, or fails, silently.

The self-check is exercised on CPU with real backends built to misbehave (one wrong by 10%, one
that raises), registered exactly like fla's: it must demote both, say why, and pick the next.
"""

from __future__ import annotations

import logging

import pytest
import torch

from axolotl_fastqwen import kernel_choice as K
from axolotl_fastqwen.ops.gated_rmsnorm import reference_gated_rmsnorm
from axolotl_fastqwen.ops.linear_cross_entropy import linear_cross_entropy
from axolotl_fastqwen.registry import kernel_backends

SHAPES = K.CheckShapes(key_heads=2, value_heads=4, key_dim=16, value_dim=16, conv_width=4, q_heads=4, kv_heads=2,
                       head_dim=16, dtype=torch.float32)


def _cpu(device):
    return None


def off_by_ten_percent(x, z, weight, *, eps):
    return 1.1 * reference_gated_rmsnorm(x, z, weight, eps=eps)


def crashes(x, z, weight, *, eps):
    raise RuntimeError("illegal memory access (simulated)")


def loss_off_by_ten_percent(hidden, weight, targets, **kwargs):
    return 1.1 * linear_cross_entropy(hidden, weight, targets, **kwargs)


def backends_with(*extra):
    return [b for b in kernel_backends()] + list(extra)


def test_cpu_selection_is_the_reference_with_reasons():
    ks = K.select_kernels("cpu", "auto")
    assert ks.names() == {"gated_delta_rule": "torch", "causal_conv": "torch", "gated_rmsnorm": "torch",
                          "varlen_attention": "torch", "rms_norm": "torch", "swiglu": "torch",
                          "linear_cross_entropy": "torch-chunked"}
    for op in ("rms_norm", "swiglu"):
        assert ks.choices[op].rejected == [("liger", "needs a CUDA device (model is on cpu)")]
        assert not ks.choices[op].backend.fallback  # transformers' own math: what runs without the plugin
    assert ("fla", "needs a CUDA device (model is on cpu)") in ks.choices["gated_delta_rule"].rejected
    assert ks.choices["linear_cross_entropy"].rejected == [("liger", "needs a CUDA device (model is on cpu)"),
                                                           ("triton", "needs a CUDA device (model is on cpu)")]
    assert not ks.choices["linear_cross_entropy"].backend.fallback  # the intended CPU path: `require` accepts it


def test_missing_kernel_on_a_gpu_is_reported_and_warned(caplog):
    missing = lambda device: "not installed (pip install something)"  # noqa: E731
    backs = [K.KernelBackend(b.op, b.name, b.fn, b.priority, missing if b.library else b.available,
                             b.library, b.fallback) for b in kernel_backends()]
    with caplog.at_level(logging.WARNING, logger="axolotl_fastqwen"):
        ks = K.select_kernels("cuda", "auto", backends=backs)
    # torch-varlen needs no library but does need CUDA, which this CPU machine lacks: also the reference
    assert ks.names()["gated_delta_rule"] == "torch"
    assert ("fla", "not installed (pip install something)") in ks.choices["gated_delta_rule"].rejected
    assert "SLOW PATH" in caplog.text and "gated_delta_rule -> torch" in caplog.text
    with pytest.raises(K.KernelUnavailableError, match="fastqwen_kernels: require"):
        K.select_kernels("cuda", "require", backends=backs)


@pytest.mark.parametrize("grad_mode", [torch.enable_grad, torch.no_grad])
def test_selfcheck_demotes_wrong_and_crashing_kernels(grad_mode, caplog):
    wrong = K.KernelBackend("gated_rmsnorm", "wrong", off_by_ten_percent, 200, _cpu, "fla")
    broken = K.KernelBackend("gated_rmsnorm", "broken", crashes, 150, _cpu, "fla")
    backs = backends_with(wrong, broken)
    ks = K.select_kernels("cpu", "auto", backends=backs)
    assert ks.names()["gated_rmsnorm"] == "wrong"
    ks.checked = False  # on CPU only GPU kernels are checked; these pretend to be GPU kernels
    with grad_mode(), caplog.at_level(logging.WARNING, logger="axolotl_fastqwen"):
        K.selfcheck(ks, SHAPES, backends=backs)
    choice = ks.choices["gated_rmsnorm"]
    assert choice.backend.name == "torch"
    reasons = dict(choice.rejected)
    assert reasons["wrong"].startswith("self-check: rel. error") and "> 2e-03" in reasons["wrong"]
    assert reasons["broken"] == "self-check: raised RuntimeError: illegal memory access (simulated)"
    assert "self-check rejected gated_rmsnorm/wrong" in caplog.text


def test_selfcheck_keeps_a_correct_kernel_and_records_its_error():
    good = K.KernelBackend("gated_rmsnorm", "good", reference_gated_rmsnorm, 200, _cpu, "fla")
    backs = backends_with(good)
    ks = K.select_kernels("cpu", "auto", backends=backs)
    ks.checked = False
    K.selfcheck(ks, SHAPES, backends=backs)
    assert ks.choices["gated_rmsnorm"].backend.name == "good"
    assert ks.choices["gated_rmsnorm"].selfcheck.startswith("fwd+bwd rel. error 0.0e+00")


def test_selfcheck_demotes_a_wrong_cross_entropy_kernel_to_torch_chunked(caplog):
    wrong = K.KernelBackend("linear_cross_entropy", "wrong-ce", loss_off_by_ten_percent, 200, _cpu, "liger_kernel")
    backs = backends_with(wrong)
    ks = K.select_kernels("cpu", "auto", backends=backs)
    assert ks.names()["linear_cross_entropy"] == "wrong-ce"
    ks.checked = False
    with caplog.at_level(logging.WARNING, logger="axolotl_fastqwen"):
        K.selfcheck(ks, SHAPES, backends=backs)
    choice = ks.choices["linear_cross_entropy"]
    assert choice.backend.name == "torch-chunked" and choice.selfcheck == "reference (no kernel passed)"
    reasons = dict(choice.rejected)
    assert reasons["wrong-ce"].startswith("self-check: rel. error") and "> 2e-03" in reasons["wrong-ce"]
    assert "self-check rejected linear_cross_entropy/wrong-ce" in caplog.text


def test_selfcheck_of_a_cross_entropy_kernel_compares_loss_and_both_gradients():
    calls = []

    def spy(hidden, weight, targets, **kwargs):
        calls.append((hidden.requires_grad, weight.requires_grad, targets.requires_grad, targets.dtype))
        return linear_cross_entropy(hidden, weight, targets, **kwargs)

    good = K.KernelBackend("linear_cross_entropy", "good-ce", spy, 200, _cpu, "liger_kernel")
    backs = backends_with(good)
    ks = K.select_kernels("cpu", "auto", backends=backs)
    ks.checked = False
    K.selfcheck(ks, SHAPES, backends=backs)
    assert ks.choices["linear_cross_entropy"].backend.name == "good-ce"
    assert ks.choices["linear_cross_entropy"].selfcheck.startswith("fwd+bwd rel. error 0.0e+00")
    assert calls == [(True, True, False, torch.int64)]


def test_reference_mode_uses_pytorch_everywhere():
    assert set(K.select_kernels("cpu", "reference").names().values()) == {"torch", "torch-chunked"}
    always = lambda device: None  # noqa: E731  (as on a GPU with every kernel installed)
    backs = [K.KernelBackend(b.op, b.name, b.fn, b.priority, always, b.library, b.fallback) for b in kernel_backends()]
    ks = K.select_kernels("cuda", "reference", backends=backs)
    assert set(ks.names().values()) == {"torch", "torch-chunked"}
    assert ("liger", "fastqwen_kernels: reference") in ks.choices["linear_cross_entropy"].rejected


def test_prefer_picks_a_named_backend_and_rejects_unknown_names():
    ks = K.select_kernels("cpu", "auto", prefer={"causal_conv": "torch"})
    assert ks.names()["causal_conv"] == "torch"
    with pytest.raises(ValueError, match="no backend 'nope' for causal_conv"):
        K.select_kernels("cpu", "auto", prefer={"causal_conv": "nope"})


def test_prefer_rejects_an_unknown_op():
    with pytest.raises(ValueError, match=r"prefer: unknown op\(s\) \['gdn'\]; the ops are gated_delta_rule"):
        K.select_kernels("cpu", "auto", prefer={"gdn": "fla"})


def test_flash_qla_is_opt_in_needs_a_gpu_and_says_what_it_cannot_take():
    from axolotl_fastqwen.ops.gated_delta_rule import BACKENDS, flashqla_limits

    by_name = {b.name: b for b in BACKENDS}
    assert by_name["flash-qla"].priority < by_name["fla"].priority  # chosen only when preferred
    ks = K.select_kernels("cpu", "auto", prefer={"gated_delta_rule": "flash-qla"})
    assert ks.names()["gated_delta_rule"] == "torch"
    assert ("flash-qla", "needs a CUDA device (model is on cpu)") in ks.choices["gated_delta_rule"].rejected
    bf = dict(dtype=torch.bfloat16)
    q, v = torch.zeros(1, 8, 2, 128, **bf), torch.zeros(1, 8, 4, 128, **bf)
    assert flashqla_limits(q, q, v) is None
    assert "FlashQLA takes one 16-bit dtype" in flashqla_limits(q.float(), q.float(), v.float())
    assert "head dims K=64, V=128" in flashqla_limits(q[..., :64], q[..., :64], v)


def test_a_preferred_kernel_that_fails_gives_way_to_the_default_not_the_reference(caplog):
    """A preference may name a backend ranked below the default: when it fails the self-check, the
    default (the next fastest that passes) takes over, not the slow reference."""
    default = K.KernelBackend("gated_rmsnorm", "default", reference_gated_rmsnorm, 200, _cpu, "fla")
    preferred = K.KernelBackend("gated_rmsnorm", "preferred", off_by_ten_percent, 50, _cpu, "fla")
    backs = backends_with(default, preferred)
    ks = K.select_kernels("cpu", "auto", backends=backs, prefer={"gated_rmsnorm": "preferred"})
    assert ks.names()["gated_rmsnorm"] == "preferred"
    ks.checked = False
    with caplog.at_level(logging.WARNING, logger="axolotl_fastqwen"):
        K.selfcheck(ks, SHAPES, backends=backs)
    choice = ks.choices["gated_rmsnorm"]
    assert choice.backend.name == "default" and choice.selfcheck.startswith("fwd+bwd rel. error 0.0e+00")
    assert dict(choice.rejected)["preferred"].startswith("self-check: rel. error")


def test_versions_and_cpu_selection_import_no_kernel_package():
    """fla prints Triton warnings when imported without a GPU: reading versions and choosing CPU
    kernels must not import it (nor causal-conv1d, flash-attn, Liger)."""
    import subprocess
    import sys

    code = ("import sys; from axolotl_fastqwen.ops.availability import versions; "
            "from axolotl_fastqwen.kernel_choice import select_kernels; v = versions(); select_kernels('cpu'); "
            "loaded = [m for m in ('fla', 'causal_conv1d', 'flash_attn', 'liger_kernel') if m in sys.modules]; "
            "print('LOADED', loaded, v.get('fla'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "LOADED [] " in out.stdout, out.stdout + out.stderr
