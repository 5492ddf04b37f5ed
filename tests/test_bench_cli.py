"""CPU smoke tests of `python -m axolotl_fastqwen bench|profile|doctor` on the tiny shape.

The commands run in-process (imports dominate on 2 cores). On CPU the stock fla paths crash
because transformers resolves fla whenever it imports: that is the failing path the run must
record and survive.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from axolotl_fastqwen.__main__ import main
from axolotl_fastqwen.bench import data
from axolotl_fastqwen.bench.shapes import build_config, build_model, get_shape, linear_params, matmul_params_per_token
from axolotl_fastqwen.stock import resolved_kernel

TINY = ["--model", "tiny", "--device", "cpu", "--budget", "256", "--seed", "0"]
PATH_KEYS = {
    "name", "layout", "status", "notes", "attempts", "launches", "calibration_loss", "step_losses",
    "tokens_per_s", "step_time_median_s", "mfu", "hfu", "peak_memory_gib", "recompiles_after_warmup",
    "triton_after_warmup", "triton_during_warmup", "padding_fraction", "seconds",
}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: the tiny model gains nothing from more, and on a shared 2-core machine
    OpenMP barriers waiting on a descheduled thread make each of ~20k small ops slow."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    """All five paths, two timed steps each; Axolotl's class-level patch must be gone afterwards."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as mq

    forwards = lambda: (mq.Qwen3_5GatedDeltaNet.forward, mq.Qwen3_5DecoderLayer.forward)  # noqa: E731
    before = forwards()
    out = tmp_path_factory.mktemp("bench")
    rc = main(["bench", *TINY, "--steps", "2", "--warmup", "0", "--out", str(out)])
    assert forwards() == before, "Axolotl's class-level patch was not undone"
    return rc, json.loads((out / "bench.json").read_text()), out


def _path(result, name):
    return next(r for r in result["paths"] if r["name"] == name)


def test_bench_writes_complete_json(bench):
    rc, result, out = bench
    assert rc == 0
    assert result["schema"] == "axolotl_fastqwen.bench/1" and result["partial"] is False
    assert [r["name"] for r in result["paths"]] == [
        "stock-torch-padded", "stock-fla-padded", "stock-fla-flattening", "axolotl-packing", "fastqwen"
    ]
    for key in ("torch", "transformers", "triton", "fla", "causal_conv1d"):
        assert key in result["versions"]
    assert "MFU = model FLOPs" in result["flops"]["formula"]
    assert result["model"]["matmul_params_per_token"]["total"] > 0
    assert result["workload"]["micro_batch_size"] >= 1
    for name in ("stock-torch-padded", "fastqwen"):
        r = _path(result, name)
        assert r["status"] == "ok", r.get("error")
        assert PATH_KEYS <= set(r), PATH_KEYS - set(r)
        assert r["steps_measured"] == 2 and len(r["step_losses"]) == 0 + 1 + 2
        assert r["tokens_per_s"] > 0 and r["mfu"] > 0 and r["hfu"] >= r["mfu"]
        assert r["triton_after_warmup"] == {} and r["recompiles_after_warmup"] == 0
    assert _path(result, "fastqwen")["patch_report"]["layers_patched"]["gated_deltanet"] == 3
    md = (out / "bench.md").read_text()
    assert "| path | layout | status | tokens/s" in md and "| fastqwen | packed | ok |" in md


def test_fastqwen_loss_matches_stock_on_the_calibration_row(bench):
    _, result, _ = bench
    stock, fast = _path(result, "stock-torch-padded"), _path(result, "fastqwen")
    assert stock["calibration_targets"] == fast["calibration_targets"] > 0
    assert fast["calibration_loss"] == pytest.approx(stock["calibration_loss"], rel=1e-4)
    assert result["calibration"]["reference"] == "stock-torch-padded"
    assert result["calibration"]["agree"] is True


def test_launch_counts_are_cpu_ops_on_cpu(bench):
    _, result, _ = bench
    assert result["launch_unit"].startswith("cpu_ops")
    for name in ("stock-torch-padded", "fastqwen"):
        launches = _path(result, name)["launches"]
        assert launches["unit"] == "cpu_ops" and launches["count"] > 100 and launches["gpu_kernel_ms"] is None


def test_a_failing_path_is_recorded_and_the_run_continues(bench):
    _, result, _ = bench
    r = _path(result, "stock-fla-padded")
    if resolved_kernel("qwen3_5", "torch_chunk_gated_delta_rule") == "torch":
        pytest.skip("fla is not importable here, so the stock fla path runs on torch and does not fail")
    assert r["status"] == "error" and r["error"] and r["attempts"]
    assert any("expected to crash" in n for n in r["notes"])
    assert _path(result, "fastqwen")["status"] == "ok"  # ran after the failure


def test_axolotl_path_is_recorded(bench):
    _, result, _ = bench
    r = _path(result, "axolotl-packing")
    assert r["status"] in ("ok", "error", "skipped")
    assert r["status"] == "skipped" or r.get("error") or r["calibration_loss"] > 0
    if r["status"] != "skipped":
        assert any("patch_qwen3_5_modeling_packing" in n for n in r["notes"])


def test_bench_runs_forwards_under_bf16_autocast_when_asked(tmp_path):
    """`--autocast on` is the Trainer's `bf16: true` (auto turns it on for bf16 on CUDA): the
    plugin path must train under it, and the record must say it ran so."""
    rc = main(["bench", *TINY, "--paths", "e", "--dtype", "bf16", "--autocast", "on", "--steps", "1",
               "--warmup", "0", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "bench.json").read_text())
    assert rc == 0 and result["model"]["autocast"] is True and "under autocast" in (tmp_path / "bench.md").read_text()
    r = _path(result, "fastqwen")
    assert r["status"] == "ok" and all(np.isfinite(r["step_losses"]))
    with pytest.raises(SystemExit, match="--autocast on needs --dtype bf16"):
        main(["bench", *TINY, "--autocast", "on", "--dtype", "fp32", "--out", str(tmp_path)])


def test_axolotl_patch_imports_without_its_trainer_callback_dependencies():
    """The GPU machine has no evaluate/datasets/wandb/trl; path (d) must still import Axolotl's own
    patch module (a fresh interpreter, those packages hidden), and leave no stand-in behind."""
    pytest.importorskip("axolotl")
    code = """
import sys
for name in ("evaluate", "datasets", "wandb", "trl", "bitsandbytes"):
    sys.modules[name] = None  # import raises, find_spec says absent: what a missing package does
from axolotl_fastqwen.bench.axolotl_import import import_axolotl_patch
module, stood_in = import_axolotl_patch("axolotl.monkeypatch.models.qwen3_5.modeling")
assert callable(module.patch_qwen3_5_modeling_packing)
assert module.__file__.startswith(__import__("os").path.dirname(__import__("axolotl").__file__))
assert any("axolotl.utils.callbacks" in s and "evaluate" in s for s in stood_in), stood_in
assert any("bitsandbytes" in s for s in stood_in), stood_in
assert "axolotl.utils.callbacks" not in sys.modules
print("ok", stood_in)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]


def test_profile_writes_trace_and_counts(tmp_path, capsys):
    rc = main(["profile", *TINY, "--steps", "1", "--warmup", "0", "--out", str(tmp_path)])
    assert rc == 0
    report = json.loads((tmp_path / "profile.json").read_text())
    assert report["unit"] == "cpu_ops" and report["launches_per_step"] > 100
    assert (tmp_path / report["trace"]).exists()
    assert "CPU ops per step" in capsys.readouterr().out


def test_doctor_runs_on_cpu_and_says_what_a_gpu_would_use(tmp_path, capsys):
    out = tmp_path / "doctor.json"
    assert main(["doctor", "--model", "tiny", "--json", str(out)]) == 0
    findings = json.loads(out.read_text())
    assert {row["op"] for row in findings["kernels"]} == {
        "gated_delta_rule", "causal_conv", "gated_rmsnorm", "varlen_attention", "linear_cross_entropy"
    }
    assert all(row["backend"] == "torch" for row in findings["kernels_here"] if row["op"] != "linear_cross_entropy")
    assert findings["problems"] and "known-bad combinations" in capsys.readouterr().out


def test_matmul_count_matches_the_linear_layers_of_a_dense_model():
    config = build_config(get_shape("tiny"), layers=4)
    model, _ = build_model(config, "qwen3_5", torch.device("cpu"), torch.float32, seed=0)
    assert matmul_params_per_token(config)["total"] == linear_params(model)


def test_every_layout_scores_the_same_targets():
    w = data.make_workload(budget=256, vocab_size=512, steps=3, seed=1)
    seqs = [w.tokens(i) for i in w.bins[0]]
    expected = sum(len(s) - 1 for s in seqs)
    for layout in ("padded", "packed", "flattening"):
        batch = data.collate(layout, seqs, 256, calibration=True)
        assert data.targets(batch) == expected, layout
    # the multipack row as Axolotl lays it out (reproduced here when its collator does not import)
    batch, _ = data.multipack_batch(seqs, 256)
    assert batch["input_ids"].shape == (1, 256) and data.targets(batch) >= expected
    tail = 256 - sum(len(s) for s in seqs)
    if tail:
        assert batch["position_ids"][0, -tail:].tolist() == list(range(tail))
    assert data.targets(data.collate("multipack", seqs, 256, calibration=True)) == expected
    # padded steps walk the packed rows' sequence order
    order = [i for b in w.bins for i in b]
    assert [i for s in w.steps("padded", 3, 2) for i in s] == order[:6]
    assert np.array_equal(w.tokens(order[0]), seqs[0])


class _Event:
    """Stands in for a profiler event in the GPU-timeline analysis (no GPU here to record real ones)."""

    def __init__(self, name, kind, start_us, dur_us):
        self._name, self._kind, self._start, self._dur = name, kind, start_us, dur_us

    def name(self):
        return self._name

    def activity_type(self):
        return self._kind

    def device_type(self):
        return "DeviceType.CUDA" if self._kind in ("kernel", "gpu_memcpy", "gpu_user_annotation") else "DeviceType.CPU"

    def start_ns(self):
        return int(self._start * 1000)

    def duration_ns(self):
        return int(self._dur * 1000)


def test_gpu_gap_analysis_attributes_idle_time_to_the_running_cpu_op():
    from axolotl_fastqwen.bench.profile import analyze

    events = [
        _Event("aten::mm", "cpu_op", 0, 40), _Event("cudaLaunchKernel", "cuda_runtime", 5, 3),
        _Event("gemm", "kernel", 10, 100),
        _Event("aten::item", "cpu_op", 105, 300),  # a host sync: the GPU idles 200 us after the gemm
        _Event("cudaStreamSynchronize", "cuda_runtime", 110, 200),
        _Event("gemm", "kernel", 310, 100), _Event("Memcpy HtoD", "gpu_memcpy", 420, 5),
        _Event("step", "gpu_user_annotation", 0, 500), _Event("norm", "kernel", 420, 10),
    ]
    report = analyze(events, steps=1, gap_us=50, top=5)
    assert report["kernels"] == 3 and report["launches_per_step"] == 3
    assert report["top_kernels"][0] == {"name": "gemm", "calls": 2, "total_ms": 0.2, "avg_us": 100.0,
                                        "share": pytest.approx(200 / 210, abs=1e-4)}
    (gap,) = report["idle_gaps"]
    assert gap["cpu_op"] == "aten::item" and gap["runtime_call"] == "cudaStreamSynchronize"
    assert gap["total_ms"] == pytest.approx(0.2)
