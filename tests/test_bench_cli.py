"""CPU smoke tests of `python -m fastqwen_bench bench|profile` on the tiny shapes, and of the installed
package's `python -m axolotl_fastqwen doctor`.

The commands run in-process (imports dominate on 2 cores). On CPU the stock fla paths crash
because transformers (before 5.25) runs fla whenever it imports: that is the failing path the run
must record and survive. Axolotl's paths run on CPU with fla's two Triton entry points stood in
(fastqwen_bench/cpu_fla.py) and every Triton-only component refused; their GPU-only set-up branches are
checked separately (`assume_cuda`: set up and undone, no forward).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from axolotl_fastqwen.__main__ import main
from fastqwen_bench import data
from fastqwen_bench.__main__ import COMMANDS as BENCH_COMMANDS
from fastqwen_bench.shapes import build_config, build_model, get_shape, linear_params, matmul_params_per_token
from axolotl_fastqwen.transformers_functions import resolved_kernel

def bench_cli(argv: list[str]) -> int:
    """`python -m fastqwen_bench ARGV`."""
    return main(argv, prog="python -m fastqwen_bench", commands=BENCH_COMMANDS)


TINY = ["--model", "tiny", "--device", "cpu", "--budget", "256", "--seed", "0"]
PATH_KEYS = {
    "name", "layout", "status", "notes", "attempts", "launches", "calibration_loss", "step_losses",
    "tokens_per_s", "step_time_median_s", "mfu", "hfu", "peak_memory_gib", "recompiles_after_warmup",
    "triton_after_warmup", "triton_during_warmup", "padding_fraction", "seconds", "allocated_after_gib",
    "gc_per_step",
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
    """All paths, two timed steps each; Axolotl's class-level patches must be gone afterwards."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as mq

    forwards = lambda: (mq.Qwen3_5GatedDeltaNet.forward, mq.Qwen3_5DecoderLayer.forward)  # noqa: E731
    before = forwards()
    out = tmp_path_factory.mktemp("bench")
    rc = bench_cli(["bench", *TINY, "--steps", "2", "--warmup", "0", "--out", str(out)])
    assert forwards() == before, "Axolotl's class-level patch was not undone"
    return rc, json.loads((out / "bench.json").read_text()), out


def _path(result, name):
    return next(r for r in result["paths"] if r["name"] == name)


def test_bench_writes_complete_json(bench):
    rc, result, out = bench
    assert rc == 0
    assert result["schema"] == "fastqwen_bench/1" and result["partial"] is False
    assert [r["name"] for r in result["paths"]] == [
        "stock-torch-padded", "stock-fla-padded", "stock-fla-flattening", "axolotl-packing", "fastqwen",
        "fastqwen-lora-kernels", "axolotl-best", "axolotl-best-cce", "axolotl-best+fp8", "axolotl-best+offload",
        "axolotl-best+fp8-no-lora-kernels", "axolotl-best+fastqwen",
        "fastqwen+ckpt-auto",
        "fastqwen+ckpt-auto+torch-norms", "axolotl-best+fastqwen+ckpt-auto", "axolotl-best+fastqwen+ckpt-auto+flash-qla",
        "axolotl-best+fastqwen+ckpt-auto+lean", "axolotl-best+fastqwen+ckpt-auto+flash-qla+lean",
        "fastqwen+ckpt-auto+lean", "fastqwen+ckpt-auto+lean+peft-lora", "fastqwen+ckpt-auto+lean+stock-mlp",
        "fastqwen+ckpt-auto+lean+liger-chunks", "fastqwen+ckpt-auto+lean+triton-loss", "fastqwen+ckpt-auto+lean+moe-graphs",
        "fastqwen+ckpt-auto+lean+no-moe-graphs", "fastqwen+ckpt-auto+lean+torch-rows", "fastqwen+ckpt-auto+lean+fp8",
        "fastqwen+ckpt-auto+lean+mlp-chunks",
        "fastqwen+ckpt-auto+lean+offload", "fastqwen+ckpt-auto+lean+fp8+offload",
        "fastqwen+ckpt-auto+lean+fp8+offload+chunks", "fastqwen+ckpt-auto+lean+fp8-forward", "stock-moe-eager", "stock-moe-grouped-mm",
    ]
    for name in ("axolotl-best+fastqwen+ckpt-auto+flash-qla", "axolotl-best+fastqwen+ckpt-auto+lean",
                 "fastqwen+ckpt-auto+lean+fp8", "fastqwen+ckpt-auto+lean+fp8-forward",
                 "fastqwen+ckpt-auto+lean+mlp-chunks", "fastqwen+ckpt-auto+lean+offload",
                 "fastqwen+ckpt-auto+lean+fp8+offload", "fastqwen+ckpt-auto+lean+fp8+offload+chunks",
                 "axolotl-best+offload", "fastqwen+ckpt-auto+lean+peft-lora", "fastqwen+ckpt-auto+lean+torch-rows",
                 "fastqwen+ckpt-auto+lean+stock-mlp", "fastqwen+ckpt-auto+lean+liger-chunks",
                 "fastqwen+ckpt-auto+lean+triton-loss", "fastqwen+ckpt-auto+lean+moe-graphs",
                 "fastqwen+ckpt-auto+lean+no-moe-graphs"):
        assert _path(result, name)["status"] == "skipped"  # no --gc, no GPU
    for key in ("torch", "transformers", "triton", "fla", "causal_conv1d"):
        assert key in result["versions"]
    assert "MFU = model FLOPs" in result["flops"]["formula"]
    assert result["model"]["matmul_params_per_token"]["total"] > 0
    assert result["workload"]["micro_batch_size"] >= 1
    with_axolotl = ("fastqwen-lora-kernels", "axolotl-best+fastqwen") if importlib.util.find_spec("axolotl") else ()
    for name in ("stock-torch-padded", "fastqwen", *with_axolotl):
        r = _path(result, name)
        assert r["status"] == "ok", r.get("error")
        assert PATH_KEYS <= set(r), PATH_KEYS - set(r)
        assert r["steps_measured"] == 2 and len(r["step_losses"]) == 0 + 1 + 2
        assert r["tokens_per_s"] > 0 and r["mfu"] > 0 and r["hfu"] >= r["mfu"]
        assert r["triton_after_warmup"] == {} and r["recompiles_after_warmup"] == 0
        assert len(r["gc_per_step"]) == 2 and all(p["ms"] >= 0 for p in r["gc_per_step"])
        # the host's time to issue each timed step is part of it; no SM clock on a CPU
        assert len(r["host_ms_per_step"]) == 2 and r["sm_clock_mhz_per_step"] == [None, None]
        assert all(0 < h <= 1000 * t + 0.1 for h, t in zip(r["host_ms_per_step"], r["step_seconds"])), (  # rounding
            r["host_ms_per_step"], r["step_seconds"])
    assert _path(result, "fastqwen")["patch_report"]["layers_patched"]["gated_deltanet"] == 3
    if with_axolotl and importlib.util.find_spec("torchao"):
        fp8 = _path(result, "axolotl-best+fp8")
        assert fp8["status"] == "ok", fp8.get("error")
        assert fp8["axolotl_fp8"]["converted"] > fp8["axolotl_fp8"]["lora_matrices_converted"] > 0
        assert fp8["axolotl_config"]["fp8"] is True
        plain = _path(result, "axolotl-best+fp8-no-lora-kernels")
        assert plain["status"] == "ok", plain.get("error")
        assert plain["axolotl_config"]["fp8"] is True and plain["axolotl_fp8"]["converted"] > 0
        assert not any(plain["axolotl_config"][k] for k in ("lora_mlp_kernel", "lora_qkv_kernel", "lora_o_kernel"))
        assert fp8["axolotl_config"]["lora_mlp_kernel"] is True
        status = {c["key"]: c["status"] for c in plain["axolotl_components"]}
        assert all(v == "not applicable" for k, v in status.items() if k.startswith("lora_")), status
    md = (out / "bench.md").read_text()
    assert "| path | layout | status | tokens/s" in md and "| fastqwen | packed | ok |" in md


def test_fastqwen_loss_matches_stock_on_the_calibration_row(bench):
    _, result, _ = bench
    stock, fast = _path(result, "stock-torch-padded"), _path(result, "fastqwen")
    assert stock["calibration_targets"] == fast["calibration_targets"] > 0
    assert fast["calibration_loss"] == pytest.approx(stock["calibration_loss"], rel=1e-4)
    assert result["calibration"]["reference"] == "stock-torch-padded"
    assert result["calibration"]["agree"] is True
    if "axolotl-best+fp8" in result["calibration"]["paths"]:  # FP8 rounds: reported, outside the agreement
        assert 1e-6 < result["calibration"]["fp8_rel_diff"]["axolotl-best+fp8"] < 2e-2
        assert 1e-6 < result["calibration"]["fp8_rel_diff"]["axolotl-best+fp8-no-lora-kernels"] < 2e-2


def test_launch_counts_are_cpu_ops_on_cpu(bench):
    _, result, _ = bench
    assert result["launch_unit"].startswith("cpu_ops")
    for name in ("stock-torch-padded", "fastqwen"):
        launches = _path(result, name)["launches"]
        assert launches["unit"] == "cpu_ops" and launches["count"] > 100 and launches["gpu_kernel_ms"] is None


def test_a_failing_path_is_recorded_and_the_run_continues(bench):
    _, result, _ = bench
    r = _path(result, "stock-fla-padded")
    if resolved_kernel("qwen3_5", "torch_chunk_gated_delta_rule", "cpu") == "torch":
        # no fla here, or transformers 5.25+, which sends CPU inputs to its PyTorch functions itself
        assert r["status"] == "ok", r
        pytest.skip("the stock fla path runs on transformers' PyTorch functions on this CPU and does not fail")
    assert r["status"] == "error" and r["error"] and r["attempts"]
    assert any("expected to crash" in n for n in r["notes"])
    assert _path(result, "fastqwen")["status"] == "ok"  # ran after the failure


HAS_AXOLOTL = importlib.util.find_spec("axolotl") is not None
needs_axolotl = pytest.mark.skipif(not HAS_AXOLOTL, reason="Axolotl is not installed in this cell")


def test_axolotl_path_is_recorded(bench):
    _, result, _ = bench
    r = _path(result, "axolotl-packing")
    if not HAS_AXOLOTL:
        assert r["status"] == "skipped" and _path(result, "axolotl-best")["status"] == "skipped"
        return
    assert r["status"] == "ok", r.get("error")
    assert any("patch_qwen3_5_modeling_packing" in n for n in r["notes"])
    assert any("cpu_fla.py" in n for n in r["notes"])  # CPU: fla's Triton entry points stood in
    stock = _path(result, "stock-torch-padded")
    assert r["calibration_loss"] == pytest.approx(stock["calibration_loss"], rel=1e-4)


def _components(record) -> dict:
    return {c["key"].split(" (")[0] + (" (kernels)" if "per-module" in c["key"] else ""): c
            for c in record["axolotl_components"]}


@needs_axolotl
def test_axolotl_best_runs_on_cpu_and_records_every_component(bench):
    _, result, out = bench
    stock = _path(result, "stock-torch-padded")
    for name in ("axolotl-best", "axolotl-best-cce"):
        r = _path(result, name)
        assert r["status"] == "ok", r.get("error")
        assert r["calibration_loss"] == pytest.approx(stock["calibration_loss"], rel=1e-4)
        comps = _components(r)
        for c in comps.values():
            assert c["status"] in ("applied", "refused", "not applicable") and c["function"]
            assert c["effect"] if c["status"] == "applied" else c["reason"]
        assert comps["lora_qkv_kernel, lora_o_kernel"]["status"] == "applied"
        assert comps["sample_packing"]["status"] == "applied"
        assert comps["lora_qkv_kernel (kernels)"]["status"] == "applied"
        assert comps["lora_o_kernel (kernels)"]["status"] == "applied"
        for key in ("fused_attn_kernel", "lora_mlp_kernel (kernels)", "liger_rms_norm", "sdpa_varlen"):
            assert comps[key]["status"] == "refused" and ("CUDA" in comps[key]["reason"]), key
        assert comps["use_scattermoe"]["status"] == "not applicable"
        assert r["axolotl_config"]["sample_packing"] is True
    cce = _components(_path(result, "axolotl-best-cce"))
    assert cce["cut_cross_entropy"]["status"] == "refused"
    assert cce["liger_fused_linear_cross_entropy"]["status"] == "not applicable"
    assert result["reference"]["path"] in ("axolotl-best", "axolotl-best-cce")
    assert all(r.get("x_axolotl_best", 0) > 0 for r in result["paths"] if r["status"] == "ok")
    md = (out / "bench.md").read_text()
    assert "axolotl-best: Axolotl components" in md and "| x axolotl-best |" in md


def test_moe_only_paths_skip_on_a_dense_shape(bench):
    _, result, _ = bench
    for name in ("stock-moe-eager", "stock-moe-grouped-mm"):
        r = _path(result, name)
        assert r["status"] == "skipped" and "dense" in r["error"]


@needs_axolotl
def test_axolotl_best_is_undone_and_the_plugin_path_after_it_is_unaffected():
    """fastqwen before and after axolotl-best on the same model: identical losses, and the
    model's modules, per-instance forwards, parameters and the modeling module as before."""
    import importlib

    from fastqwen_bench import run
    from fastqwen_bench.restore import fingerprint
    from axolotl_fastqwen import registry
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    args = run.make_parser().parse_args([*TINY[:-2], "--seed", "3", "--steps", "1", "--warmup", "0"])
    setup = run.prepare(args, steps_per_path=2)
    modeling = importlib.import_module(registry.family("qwen3_5").modeling_module)
    before, sdpa = fingerprint(setup.model, [modeling]), ALL_ATTENTION_FUNCTIONS["sdpa"]
    first = run.run_path(setup, "fastqwen")
    best = run.run_path(setup, "axolotl-best")
    assert best["status"] == "ok", best.get("error")
    assert fingerprint(setup.model, [modeling]) == before and ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa
    again = run.run_path(setup, "fastqwen")
    assert first["status"] == again["status"] == "ok"
    assert again["calibration_loss"] == first["calibration_loss"]
    assert again["step_losses"] == first["step_losses"]
    assert best["calibration_loss"] == pytest.approx(first["calibration_loss"], rel=1e-4)


@needs_axolotl
@pytest.mark.parametrize("shape", ["tiny", "tiny-moe", "tiny-next"])
def test_axolotl_best_gpu_branches_apply_and_undo_fully(shape):
    """The CUDA-only set-up (Liger classes and the model rebuilt with them, fused attention,
    sdpa_varlen, ScatterMoE, the LoRA MLP kernel) applied on a CPU model, checked, and undone:
    no forward runs (the kernels are Triton), so the GPU run is the first to execute them."""
    import importlib

    from peft import LoraConfig, get_peft_model
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel

    from fastqwen_bench.axolotl_best import axolotl_best
    from fastqwen_bench.restore import fingerprint
    from fastqwen_bench.shapes import lora_targets
    from axolotl_fastqwen import registry

    s = get_shape(shape)
    model, _ = build_model(build_config(s, 4), s.family, torch.device("cpu"), torch.float32, seed=0)
    for p in model.parameters():
        p.requires_grad_(False)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=lora_targets(s.family)))
    modeling = importlib.import_module(registry.family(s.family).modeling_module)
    before = fingerprint(model, [modeling])
    sdpa, correct = ALL_ATTENTION_FUNCTIONS["sdpa"], PreTrainedModel.get_correct_experts_implementation
    experts_impl = model.get_base_model().config._experts_implementation
    with axolotl_best(model, s.family, torch.device("cpu"), torch.bfloat16, loss="liger", gc=False,
                      assume_cuda=True) as info:
        comps = {c["key"].split(" (")[0] + (" (kernels)" if "per-module" in c["key"] else ""): c
                 for c in info["components"]}
        status = {k: c["status"] for k, c in comps.items()}
        assert status["liger_rms_norm"] == status["liger_fused_linear_cross_entropy"] == "applied"
        assert status["(model construction with the patched classes)"] == "applied"
        assert status["sdpa_varlen"] == "applied" and ALL_ATTENTION_FUNCTIONS["sdpa"] is not sdpa
        types = {type(m).__name__ for m in model.modules()}
        assert any(t.startswith("LigerRMSNorm") for t in types)
        if s.family == "qwen3_next":
            assert status["fused_attn_kernel"] == "not applicable"
            assert status["liger_glu_activation"] == "refused"  # would replace the experts (ScatterMoE)
        else:
            assert status["fused_attn_kernel"] == status["liger_glu_activation"] == "applied"
            assert "FusedRMSNormGated" in types and "LigerSwiGLUMLP" in types
        if s.family == "qwen3_5":
            assert status["lora_mlp_kernel (kernels)"] == "applied"
            assert status["use_scattermoe"] == "not applicable"
        else:
            assert status["use_scattermoe"] == status["experts_implementation: scattermoe"] == "applied"
            assert model.get_base_model().config._experts_implementation == "scattermoe"
            assert status["lora_mlp_kernel (kernels)"] == "not applicable"
    assert fingerprint(model, [modeling]) == before
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa and "scattermoe" not in ALL_EXPERTS_FUNCTIONS
    assert PreTrainedModel.get_correct_experts_implementation is correct
    assert model.get_base_model().config._experts_implementation == experts_impl


def test_parse_paths_letters_and_order():
    from fastqwen_bench.paths import EXECUTION_ORDER, parse_paths

    assert parse_paths("f,e,a") == ["stock-torch-padded", "fastqwen", "axolotl-best"]
    assert parse_paths("g,h,i,d") == ["stock-moe-eager", "stock-moe-grouped-mm", "axolotl-packing",
                                      "axolotl-best-cce"]
    assert parse_paths("all") == list(EXECUTION_ORDER) and EXECUTION_ORDER[-11:] == (
        "axolotl-packing", "axolotl-best", "axolotl-best-cce", "axolotl-best+offload", "axolotl-best+fp8",
        "axolotl-best+fp8-no-lora-kernels",
        "axolotl-best+fastqwen",
        "axolotl-best+fastqwen+ckpt-auto", "axolotl-best+fastqwen+ckpt-auto+flash-qla",
        "axolotl-best+fastqwen+ckpt-auto+lean", "axolotl-best+fastqwen+ckpt-auto+flash-qla+lean",
    )  # Axolotl's patches last
    assert parse_paths("o,l") == ["axolotl-best+fastqwen+ckpt-auto", "axolotl-best+fastqwen+ckpt-auto+lean"]
    assert parse_paths("l,m,k") == ["fastqwen+ckpt-auto", "axolotl-best+fastqwen", "axolotl-best+fastqwen+ckpt-auto"]
    assert parse_paths("x,y,z") == ["fastqwen+ckpt-auto+lean+offload", "fastqwen+ckpt-auto+lean+fp8+offload+chunks",
                                    "axolotl-best+offload"]
    assert parse_paths("A,x") == ["fastqwen+ckpt-auto+lean+offload", "fastqwen+ckpt-auto+lean+fp8+offload"]
    with pytest.raises(ValueError, match="f=axolotl-best"):
        parse_paths("zz")


def test_lora_targets_of_the_moe_shapes():
    """35B-A3B: the shared expert's gate/up/down are LoRA-adapted, the routed experts are not;
    Qwen3-Next: peft would turn gate/up/down into routed-expert LoRA, so they are left out, and
    --lora-experts adds the routed experts as target_parameters."""
    from peft import LoraConfig, get_peft_model

    from fastqwen_bench.shapes import lora_target_parameters, lora_targets

    def adapted(shape, experts=False):
        s = get_shape(shape)
        model, _ = build_model(build_config(s, 4), s.family, torch.device("cpu"), torch.float32, seed=0)
        cfg = LoraConfig(r=4, lora_alpha=8, target_modules=lora_targets(s.family),
                         target_parameters=lora_target_parameters(s.family, experts) or None)
        peft_model = get_peft_model(model, cfg)
        return {n.split(".")[-2] + "." + n.split(".")[-1] if "lora_A" not in n else ""
                for n, m in peft_model.named_modules() if hasattr(m, "lora_A")} - {""}

    moe = adapted("tiny-moe")
    assert {"shared_expert.gate_proj", "shared_expert.up_proj", "shared_expert.down_proj",
            "linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.out_proj", "self_attn.q_proj"} <= moe
    assert not any(name.endswith("experts") for name in moe)
    nxt = adapted("tiny-next")
    assert "linear_attn.in_proj_qkvz" in nxt and not any(name.endswith("experts") for name in nxt)
    assert any(name.endswith("mlp.experts") for name in adapted("tiny-next", experts=True))
    assert any(name.endswith("mlp.experts") for name in adapted("tiny-moe", experts=True))
    with pytest.raises(ValueError, match="MoE"):
        lora_target_parameters("qwen3_5", True)


def test_budget_shares_and_reference_ratios():
    from types import SimpleNamespace

    from fastqwen_bench.run import budget_skip, path_budget, reference_ratios

    args = SimpleNamespace(max_path_seconds=150.0, max_total_seconds=None)
    assert path_budget(args, 1000.0, 3) == 150.0
    args.max_total_seconds = 480.0
    assert path_budget(args, 60.0, 3) == 140.0 and path_budget(args, 60.0, 1) == 150.0
    assert path_budget(args, 470.0, 2) == 5.0
    assert budget_skip("fastqwen", 5.0)["status"] == "skipped"
    records = [{"name": "axolotl-best", "status": "ok", "tokens_per_s": 100.0},
               {"name": "axolotl-best-cce", "status": "ok", "tokens_per_s": 125.0},
               {"name": "fastqwen", "status": "ok", "tokens_per_s": 150.0}, {"name": "stock-fla-padded"}]
    ref = reference_ratios(records)
    assert ref["path"] == "axolotl-best-cce" and [r.get("x_axolotl_best") for r in records] == [0.8, 1.0, 1.2, None]
    assert reference_ratios([{"name": "fastqwen", "status": "ok", "tokens_per_s": 1.0}])["path"] is None


def test_a_run_whose_setup_used_its_whole_budget_still_writes_its_outputs(tmp_path):
    """Every path skipped for time (a cold GPU's set-up took the budget): bench.json / bench.md are
    written with each path's reason, not a crash on the calibration no path produced (seen on an H100)."""
    rc = bench_cli(["bench", *TINY, "--paths", "e,s", "--steps", "1", "--warmup", "0", "--max-total-seconds", "1",
                    "--out", str(tmp_path)])
    result = json.loads((tmp_path / "bench.json").read_text())
    assert rc == 0 and [r["status"] for r in result["paths"]] == ["skipped", "skipped"]
    assert result["calibration"]["reference"] is None and "| fastqwen | " in (tmp_path / "bench.md").read_text()


def test_checkpointing_auto_path_runs_and_records_why_it_recomputes_everything_on_cpu(tmp_path):
    """Path m is path e under fastqwen_checkpointing: auto. A CPU has no peak-memory counters, so
    the fitter recomputes every layer and says why; the losses are path e's (same weights, same rows)."""
    rc = bench_cli(["bench", *TINY, "--paths", "e,m,w", "--gc", "--steps", "1", "--warmup", "0", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "bench.json").read_text())
    e, m = _path(result, "fastqwen"), _path(result, "fastqwen+ckpt-auto")
    w = _path(result, "fastqwen+ckpt-auto+lean+mlp-chunks")  # path m with lean activations and MLP chunks
    assert w["status"] == "ok" and w["patch_report"]["mlp_chunks"]["chunk_tokens"] == 8192
    assert w["calibration_loss"] == m["calibration_loss"]  # 256-token rows: within one chunk
    assert rc == 0 and e["status"] == m["status"] == "ok"
    assert m["checkpointing"]["phase"] == "off" and "no CUDA device" in m["checkpointing"]["summary"]
    assert m["calibration_loss"] == e["calibration_loss"]
    # its fitting steps ran on extra rows: the timed rows are path e's (same tokens, same slots)
    assert m["rows"]["timed"] == e["rows"]["timed"] == [1] and m["rows"]["profiled"] == e["rows"]["profiled"] == 0
    assert m["rows"]["warmup"] == [2] and e["rows"]["warmup"] == []  # fitting rows past the common ones; off: one
    assert m["real_tokens_per_step"] == e["real_tokens_per_step"]
    assert "fastqwen_checkpointing: auto" in (tmp_path / "bench.md").read_text()
    rc = bench_cli(["bench", *TINY, "--paths", "m", "--steps", "1", "--warmup", "0", "--out", str(tmp_path / "nogc")])
    skipped = _path(json.loads((tmp_path / "nogc" / "bench.json").read_text()), "fastqwen+ckpt-auto")
    assert skipped["status"] == "skipped" and "--gc" in skipped["error"]


def test_offload_paths_run_and_record_what_their_offloaders_moved(tmp_path):
    """Path x is path s with fastqwen_checkpoint_offload, y axolotl-best with Axolotl's
    `activation_offloading: hidden_states` around each step. Both offload CUDA tensors only: on a CPU
    they move nothing and give their base paths' calibration losses; their records say what moved."""
    pytest.importorskip("axolotl")
    rc = bench_cli(["bench", *TINY, "--paths", "s,x,f,y", "--gc", "--steps", "1", "--warmup", "0", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "bench.json").read_text())
    s, x = _path(result, "fastqwen+ckpt-auto+lean"), _path(result, "fastqwen+ckpt-auto+lean+offload")
    f, y = _path(result, "axolotl-best"), _path(result, "axolotl-best+offload")
    assert rc == 0 and s["status"] == x["status"] == f["status"] == y["status"] == "ok", (x.get("error"), y.get("error"))
    assert x["calibration_loss"] == s["calibration_loss"] and y["calibration_loss"] == f["calibration_loss"]
    moved = x["patch_report"]["checkpoint_offload"]
    assert moved["layers"] == 4 and moved["last_forward_inputs"] == 0  # CPU tensors stay where they are
    assert y["axolotl_config"]["activation_offloading"] == "hidden_states"
    assert y["axolotl_offload"]["marked_tensors"] > 0 and y["axolotl_offload"]["offloaded_tensors"] == 0
    left = s["patch_report"]["checkpoint_offload"]  # the line's default, auto: a CPU has nothing to move
    assert left["mode"] == "auto" and not left["active"] and left["offloaded_inputs"] == 0, left
    from transformers import GradientCheckpointingLayer

    assert GradientCheckpointingLayer.__call__.__module__ == "transformers.modeling_layers"  # Axolotl's marker undone


def test_bench_runs_forwards_under_bf16_autocast_when_asked(tmp_path):
    """`--autocast on` is the Trainer's `bf16: true` (auto turns it on for bf16 on CUDA): the
    plugin path must train under it, and the record must say it ran so."""
    rc = bench_cli(["bench", *TINY, "--paths", "e", "--dtype", "bf16", "--autocast", "on", "--steps", "1",
               "--warmup", "0", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "bench.json").read_text())
    assert rc == 0 and result["model"]["autocast"] is True and "under autocast" in (tmp_path / "bench.md").read_text()
    r = _path(result, "fastqwen")
    assert r["status"] == "ok" and all(np.isfinite(r["step_losses"]))
    with pytest.raises(SystemExit, match="--autocast on needs --dtype bf16"):
        bench_cli(["bench", *TINY, "--autocast", "on", "--dtype", "fp32", "--out", str(tmp_path)])


def test_axolotl_patch_imports_without_its_trainer_callback_dependencies():
    """The GPU machine has no evaluate/datasets/wandb/trl; path (d) must still import Axolotl's own
    patch module (a fresh interpreter, those packages hidden), and leave no stand-in behind."""
    pytest.importorskip("axolotl")
    code = """
import sys
for name in ("evaluate", "datasets", "wandb", "trl", "bitsandbytes", "pydantic"):
    sys.modules[name] = None  # import raises, find_spec says absent: what a missing package does
from fastqwen_bench.axolotl_import import import_axolotl_patch
module, stood_in = import_axolotl_patch("axolotl.monkeypatch.models.qwen3_5.modeling")
assert callable(module.patch_qwen3_5_modeling_packing)
assert module.__file__.startswith(__import__("os").path.dirname(__import__("axolotl").__file__))
assert any("axolotl.utils.callbacks" in s and "evaluate" in s for s in stood_in), stood_in
assert any("bitsandbytes" in s for s in stood_in), stood_in
assert "axolotl.utils.callbacks" not in sys.modules
# the GPU image has no pydantic either: Axolotl's Liger / kernels package __init__s need it
from fastqwen_bench.axolotl_import import axolotl_modules
names = ["axolotl.integrations.liger.models.qwen3_5", "axolotl.integrations.kernels.libs.scattermoe_lora.experts",
         "axolotl.monkeypatch.lora_kernels", "axolotl.monkeypatch.attention.sdpa_varlen"]
with axolotl_modules(names) as (mods, stood, errors):
    assert set(mods) == set(names), errors
    assert any("axolotl.integrations.liger" in s and "pydantic" in s for s in stood), stood
for name in ("axolotl.integrations.liger", "axolotl.integrations.kernels", "bitsandbytes"):
    assert name not in sys.modules, name
print("ok", stood_in)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]


def test_profile_writes_trace_and_counts(tmp_path, capsys):
    rc = bench_cli(["profile", *TINY, "--steps", "1", "--warmup", "0", "--out", str(tmp_path)])
    assert rc == 0
    report = json.loads((tmp_path / "profile.json").read_text())
    assert report["unit"] == "cpu_ops" and report["launches_per_step"] > 100
    assert (tmp_path / report["trace"]).exists()
    assert "CPU ops per step" in capsys.readouterr().out


def test_profile_drives_the_checkpoint_fitter_on_an_auto_path(tmp_path, capsys):
    """A `fastqwen_checkpointing: auto` path is profiled as it trains: its fitting steps run in the
    warm-up and the report carries the fitter's record (on a CPU: off, every layer recomputed)."""
    rc = bench_cli(["profile", *TINY, "--gc", "--path", "fastqwen+ckpt-auto", "--steps", "1", "--warmup", "0",
               "--no-trace", "--out", str(tmp_path)])
    assert rc == 0
    report = json.loads((tmp_path / "profile.json").read_text())
    assert report["checkpointing"]["mode"] == "auto" and report["checkpointing"]["phase"] == "off"
    out = capsys.readouterr().out
    assert "warm-up 5/5" in out and "checkpointing:" in out


def test_doctor_runs_on_cpu_and_says_what_a_gpu_would_use(tmp_path, capsys):
    out = tmp_path / "doctor.json"
    assert main(["doctor", "--model", "qwen3.5-35b-a3b", "--json", str(out)]) == 0
    findings = json.loads(out.read_text())
    assert {row["op"] for row in findings["kernels"]} == {
        "gated_delta_rule", "causal_conv", "gated_rmsnorm", "varlen_attention", "rms_norm", "swiglu",
        "linear_cross_entropy"
    }
    assert all(row["backend"] == "torch" for row in findings["kernels_here"] if row["op"] != "linear_cross_entropy")
    assert findings["problems"] and "known-bad combinations" in capsys.readouterr().out
    # the experts implementations transformers can dispatch to here, as its ExpertsInterface lists them
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError:
        assert "transformers" in findings["experts"]
    else:
        assert "grouped_mm" in findings["experts"]["registered"]
        assert set(findings["experts"]["registered"].split(", ")) == {"eager", *ALL_EXPERTS_FUNCTIONS.valid_keys()}


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


def test_long_streams_draw_sequences_from_8k_to_the_row_and_single_rows():
    """Issue 37's streams: `long` lengths within [min(8192, budget/4), budget], some near each end,
    one to a few a row; `single` one sequence of exactly the budget a row; `sft` unchanged."""
    w = data.make_workload(budget=65_536, vocab_size=512, steps=20, seed=0, stream="long")
    assert w.lengths.min() >= 8192 and w.lengths.max() <= 65_536 and w.stream == "long"
    assert (w.lengths < 12_000).any() and (w.lengths > 48_000).any()
    assert max(len(b) for b in w.bins) <= 8 and all(sum(w.lengths[i] for i in b) <= 65_536 for b in w.bins)
    assert "log-uniform over [8192, 65536]" in w.describe()["length_distribution"]
    small = data.make_workload(budget=4096, vocab_size=512, steps=3, seed=0, stream="long")
    assert small.lengths.min() >= 1024 and small.lengths.max() <= 4096  # a quarter of a small row
    single = data.make_workload(budget=131_072, vocab_size=512, steps=3, seed=0, stream="single")
    assert set(single.lengths.tolist()) == {131_072} and all(len(b) == 1 for b in single.bins)
    assert single.default_micro_batch_size(3) == 1
    assert data.make_workload(budget=8192, vocab_size=512, steps=3, seed=0).lengths.max() <= 2048
    with pytest.raises(ValueError, match="unknown stream"):
        data.make_workload(budget=8192, vocab_size=512, steps=3, stream="longest")


def test_bench_trains_a_single_sequence_row(tmp_path):
    """`--stream single`: each step one sequence as long as the row, through the plugin's path and
    stock's padded one (same sequence, no padding), with the same calibration loss."""
    rc = bench_cli(["bench", "--model", "tiny", "--device", "cpu", "--budget", "2048", "--seed", "0", "--stream",
                    "single", "--paths", "a,e", "--steps", "1", "--warmup", "0", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "bench.json").read_text())
    a, e = _path(result, "stock-torch-padded"), _path(result, "fastqwen")
    assert rc == 0 and a["status"] == e["status"] == "ok"
    assert result["workload"]["stream"] == "single" and e["padding_fraction"] == a["padding_fraction"] == 0
    assert abs(a["calibration_loss"] - e["calibration_loss"]) <= 1e-4 * a["calibration_loss"]


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
    from fastqwen_bench.profile import analyze

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


def test_kernel_time_by_category_splits_a_moe_step():
    from fastqwen_bench.profile import analyze, categorize

    names = {
        "nvjet_sm90_tst_256x128_64x4_2x1_v_bz_coopA_NNT": "gemm",
        "chunk_gated_delta_rule_fwd_kernel_h_blockdim64": "gdn",
        "solve_tril_64x64_kernel": "gdn",
        "causal_conv1d_fwd_kernel": "conv",
        "pytorch_flash::flash_fwd_kernel": "attention",
        "_rms_norm_forward_kernel": "norms",
        "liger_cross_entropy_kernel": "loss",
        "void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor>": "optimizer",
        "void at::native::vectorized_elementwise_kernel<4, CUDAFunctor_add>": "elementwise/copy",
        "void at::native::direct_copy_kernel_cuda": "elementwise/copy",
        "_scatter2scatter": "experts",
        "void at::native::sbtopk::gatherTopK<float>": "router",
    }
    for name, category in names.items():
        assert categorize(name, moe=True) == category, name
    assert categorize("void at::native::sbtopk::gatherTopK<float>", moe=False) != "router"
    events = [_Event(n, "kernel", 100 * i, 10 * (i + 1)) for i, n in enumerate(names)]
    report = analyze(events, steps=2, gap_us=1e9, top=5, moe=True)
    cats = report["categories"]
    assert set(cats) == set(names.values())
    assert sum(c["share"] for c in cats.values()) == pytest.approx(1.0, abs=1e-3)
    assert cats["gdn"]["launches_per_step"] == 1.0 and cats["experts"]["kernels"] == ["_scatter2scatter"]
    assert "router" in report["category_rules"]


def test_a_kernel_preference_path_that_does_not_take_is_skipped_not_run_as_its_base():
    """Path n (FlashQLA) on a machine where FlashQLA cannot run would time path l again under
    another name: it is skipped with the selection's reason, and the model is left unpatched."""
    import torch
    from tiny_assets import build_tiny_model

    from fastqwen_bench.common import PathSkipped
    from fastqwen_bench.paths import _plugin
    from axolotl_fastqwen.patching.patch import STATE_ATTR

    model = build_tiny_model("qwen3_5")
    info: dict = {"notes": []}
    with pytest.raises(PathSkipped, match=r"gated_delta_rule: flash-qla did not take \(needs a CUDA device"):
        with _plugin(model, torch.device("cpu"), info, {"gated_delta_rule": "flash-qla"}):
            pass
    assert getattr(model, STATE_ATTR, None) is None
    with _plugin(model, torch.device("cpu"), info, {"gated_delta_rule": "torch"}):
        assert info["patch_report"].kernels.names()["gated_delta_rule"] == "torch"


def test_launch_census_groups_launches_by_the_op_chain_that_issued_them():
    """Real profiler events of a CPU run: each leaf aten op counts as one launch, keyed by the op
    and its callers up to the autograd function that owns it (its forward record or its backward
    node), so a census row says which layer code a launch comes from."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from fastqwen_bench.profile import launch_census
    from census_probe import Scale

    x = torch.ones(8, dtype=torch.bfloat16, requires_grad=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            Scale.apply(x).sum().backward()
    rows = {r["ops"]: r for r in launch_census(prof.events(), steps=3, top=100)}
    # the upcast inside forward, keyed by the function that issued it, once per step
    assert rows["aten::copy_ < aten::_to_copy < aten::to < Scale"]["launches_per_step"] == 1.0, rows
    # the backward's downcast, keyed by its autograd node
    assert rows["aten::copy_ < aten::_to_copy < aten::to < ScaleBackward"]["launches_per_step"] == 1.0, rows
    # views and allocations launch no kernel on a GPU and are not counted
    assert not any(ops.startswith(("aten::view", "aten::as_strided", "aten::empty")) for ops in rows), rows
    assert all(r["category"] == "cpu op" and r["ms_per_step"] == 0.0 for r in rows.values())


def test_axolotls_fp8_conversion_is_undone_with_the_same_parameters():
    """The `axolotl-best+fp8` path swaps nn.Linear modules for torchao's Float8Linear as Accelerate
    does for Axolotl's `fp8: true` (the first and last linear kept), then puts every module back: the
    same objects, the same Parameters (the optimizer built before the path still holds them)."""
    pytest.importorskip("torchao")
    pytest.importorskip("accelerate")
    from peft import LoraConfig, get_peft_model
    from torchao.float8.float8_linear import Float8Linear

    from fastqwen_bench.axolotl_fp8 import axolotl_fp8

    model = get_peft_model(build_model(build_config(get_shape("tiny"), None), "qwen3_5", torch.device("cpu"),
                                       torch.float32, 0)[0], LoraConfig(r=16, target_modules=["q_proj", "gate_proj"]))
    before = {name: m for name, m in model.named_modules()}
    params = {name: p for name, p in model.named_parameters()}
    with axolotl_fp8(model, torch.device("cpu")) as info:
        swapped = [name for name, m in model.named_modules() if isinstance(m, Float8Linear)]
        assert len(swapped) == info["converted"] > info["lora_matrices_converted"] > 0
        linear = [name for name, m in before.items() if isinstance(m, torch.nn.Linear)]
        assert linear[0] not in swapped and linear[-1] not in swapped  # accelerate's filter: first and last kept
        assert all(p is params[name] for name, p in model.named_parameters())
    assert {name: m for name, m in model.named_modules()} == before
    assert all(p is params[name] for name, p in model.named_parameters())


def test_path_c_runs_the_routed_rows_and_the_shared_expert_as_before_the_kernels():
    """Path C pins every experts module's row work to PyTorch's ops and every sparse block to
    transformers' forward while it runs (what `s` changes over it), and takes both off after."""
    from axolotl_fastqwen.layers.experts_implementation import experts_modules
    from axolotl_fastqwen.layers.grouped_experts import ROUTED_KERNELS_ATTR
    from axolotl_fastqwen.layers.moe_block import OWN_FORWARD_ATTR
    from fastqwen_bench.paths import installed
    from tiny_assets import build_tiny_model

    model = build_tiny_model("qwen3_5_moe")
    blocks = [m for m in model.modules() if hasattr(m, "shared_expert_gate")]
    with installed("fastqwen+ckpt-auto+lean+torch-rows", model, "qwen3_5_moe", torch.device("cpu"), gc=True):
        assert {m.__dict__.get(ROUTED_KERNELS_ATTR) for m in experts_modules(model)} == {"torch"}
        assert blocks and all(b.__dict__.get(OWN_FORWARD_ATTR) for b in blocks)
    assert all(OWN_FORWARD_ATTR not in b.__dict__ and "_fastqwen" not in b.__dict__ for b in blocks)
    assert all(ROUTED_KERNELS_ATTR not in m.__dict__ for m in experts_modules(model))


def test_path_e_runs_the_loss_on_liger_s_own_chunks_while_it_runs():
    """Path E sets the loss's chunk floor to 1 (Liger's own chunk sizes) for its block only."""
    from axolotl_fastqwen.ops import linear_cross_entropy
    from fastqwen_bench.paths import LETTERS, installed
    from tiny_assets import build_tiny_model

    floor = linear_cross_entropy.LIGER_MIN_CHUNK_TOKENS
    with installed(LETTERS["E"], build_tiny_model("qwen3_5"), "qwen3_5",
                   torch.device("cpu"), gc=True):
        assert linear_cross_entropy.LIGER_MIN_CHUNK_TOKENS == 1
    with installed("fastqwen+ckpt-auto+lean", build_tiny_model("qwen3_5"), "qwen3_5", torch.device("cpu"), gc=True):
        assert linear_cross_entropy.LIGER_MIN_CHUNK_TOKENS == floor > 1
    assert linear_cross_entropy.LIGER_MIN_CHUNK_TOKENS == floor


def test_a_step_s_garbage_collections_are_timed_and_counted():
    """The timed step records Python's collections inside it (the MoE step times' spread, issue 36):
    a step that collects shows its pause and generation; one that does not shows none."""
    import gc

    from fastqwen_bench.run import _timed

    pauses = []
    _timed(lambda: (gc.collect(), torch.zeros(()))[1], torch.device("cpu"), pauses)
    _timed(lambda: torch.zeros(()), torch.device("cpu"), pauses)
    assert pauses[0]["ms"] > 0 and pauses[0]["collections"].get("gen2", 0) >= 1, pauses
    assert pauses[1]["collections"].get("gen2", 0) == 0, pauses


def test_host_profile_says_where_the_host_spends_a_step(tmp_path):
    """`--host-profile N`: N steps after the timed ones, on the timed rows, under pyinstrument: the sampled
    time per step by package (the plugin's own code among them) and by function, the call tree beside the
    outputs, a line in bench.md. The timed steps are the same rows as without it."""
    pytest.importorskip("pyinstrument")
    rc = bench_cli(["bench", *TINY, "--paths", "e", "--steps", "1", "--warmup", "0", "--host-profile", "2",
                    "--out", str(tmp_path)])
    e = _path(json.loads((tmp_path / "bench.json").read_text()), "fastqwen")
    profile = e["host_profile"]
    assert rc == 0 and e["rows"]["timed"] == [1] and profile["steps"] == 2 and profile["ms_per_step"] > 0
    assert "axolotl_fastqwen" in profile["by_package_ms"] and "C functions" in profile["by_package_ms"]
    assert abs(sum(profile["by_package_share"].values()) - 1) < 0.02  # self times add up to the sampled time
    assert profile["top_self"] and (tmp_path / profile["tree"]).read_text().count("gated_deltanet_forward")
    assert "fastqwen: host profile (pyinstrument, 2 steps" in (tmp_path / "bench.md").read_text()


def test_qlora_base_every_path_trains_the_same_4bit_base(tmp_path):
    """`--qlora`: the base quantized as Axolotl loads its QLoRA MoE examples (`load_in_4bit`: every decoder
    linear a bitsandbytes Linear4bit; `quantize_moe_experts`: the expert stacks in 4 bits) before peft's
    adapters (on the experts too, through Axolotl's peft matching patch, as its loader applies it). The
    plugin's path runs its experts on the 4-bit stacks and agrees with stock transformers' eager experts on
    the same base. A subprocess: Axolotl's peft patch is process-wide."""
    pytest.importorskip("bitsandbytes")
    pytest.importorskip("axolotl.monkeypatch.moe_quant")
    out = tmp_path / "q"
    run = subprocess.run([sys.executable, "-m", "fastqwen_bench", "bench", "--model", "tiny-moe", "--device", "cpu",
                          "--budget", "256", "--seed", "0", "--qlora", "--lora-experts", "--gc", "--paths", "s,h",
                          "--steps", "1", "--warmup", "0", "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads((out / "bench.json").read_text())
    qlora = result["model"]["qlora"]
    assert qlora["linears"] > 0 and qlora["expert_stacks"] == 2 * result["model"]["layers"]
    assert qlora["weights_bytes_after"] < qlora["weights_bytes_before"] / 2
    s, stock = _path(result, "fastqwen+ckpt-auto+lean"), _path(result, "stock-moe-eager")
    assert s["status"] == "ok" and stock["status"].startswith("ok"), (s.get("error"), stock.get("error"))
    experts = s["patch_report"]["experts"]
    assert experts["implementation"] == "fastqwen_grouped" and "4-bit nf4" in experts["stacks"]
    assert abs(s["calibration_loss"] - stock["calibration_loss"]) <= 1e-4 * abs(stock["calibration_loss"])
    refused = subprocess.run([sys.executable, "-m", "fastqwen_bench", "bench", *TINY, "--qlora", "--full",
                              "--out", str(tmp_path / "f")], capture_output=True, text=True, timeout=300)
    assert refused.returncode != 0 and "--qlora quantizes the frozen base for adapters" in refused.stderr


def test_a_quantized_base_gives_axolotl_best_its_qlora_keys():
    """`axolotl-best` on a `--qlora` base runs Axolotl's QLoRA code paths (its LoRA kernels' 4-bit branch,
    ScatterMoE's 4-bit experts): the keys Axolotl would have loaded that base with."""
    pytest.importorskip("bitsandbytes")
    from fastqwen_bench.quantized_base import axolotl_keys, quantize_base
    from tiny_assets import build_tiny_model

    model = build_tiny_model("qwen3_5_moe")
    assert axolotl_keys(model, moe=True) == {}
    quantize_base(model, torch.float32)
    assert axolotl_keys(model, moe=True) == {"adapter": "qlora", "load_in_4bit": True, "quantize_moe_experts": True}


def test_moe_graphs_path_says_when_its_captures_fall_in_the_timed_steps(tmp_path, monkeypatch):
    """Path G (`fastqwen_moe_cuda_graphs`) captures each block after its warm-up calls: with too few warm-up
    steps the captures (and the calls deferred for memory) land in the profiled and timed steps, and the
    path's notes say so; with enough, they do not. On a CPU the graphs are stood in (tests/eager_graph.py),
    and every layer keeps its activations, as `auto` keeps them on a GPU where they fit."""
    from eager_graph import install_on_cpu

    from axolotl_fastqwen.patching import moe_cuda_graphs

    monkeypatch.setattr(moe_cuda_graphs.MoeCudaGraphs, "install", install_on_cpu(keep_layers=True))
    notes = {}
    for warmup in (0, 3):
        out = tmp_path / str(warmup)
        rc = bench_cli(["bench", "--model", "tiny-moe", *TINY[2:], "--paths", "G", "--gc", "--steps", "2",
                        "--warmup", str(warmup), "--out", str(out)])
        g = _path(json.loads((out / "bench.json").read_text()), "fastqwen+ckpt-auto+lean+moe-graphs")
        assert rc == 0 and g["status"] == "ok", g.get("error")
        assert g["patch_report"]["moe_cuda_graphs"]["captured"] > 0, g["patch_report"]["moe_cuda_graphs"]
        notes[warmup] = [n for n in g["notes"] if n.startswith("moe cuda graphs not settled")]
    assert notes[0] and "capture(s)" in notes[0][0] and notes[3] == []
