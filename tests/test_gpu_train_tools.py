"""The GPU `axolotl train` tooling (tools/gpu): config derivation and log parsing, on CPU."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools" / "gpu"))

import make_train_config as mtc  # noqa: E402
import parse_train_logs as ptl  # noqa: E402

PATHS = dict(model="/m", data="/d.jsonl", out_dir="/o", prepared="/p", budget=8192, max_steps=60, seed=42,
             gradient_checkpointing=False)


def test_axolotl_run_is_axolotls_fastest_config_without_our_plugin():
    cfg = mtc.build("axolotl", **PATHS)
    assert mtc.FASTQWEN not in cfg["plugins"] and mtc.LIGER in cfg["plugins"] and mtc.FLA_GUARD in cfg["plugins"]
    for key, value in mtc.AXOLOTL_FAST.items():
        assert cfg[key] == value
    assert not any(k.startswith("fastqwen_") for k in cfg)
    assert cfg["attn_implementation"] == "sdpa" and cfg["flash_attention"] is False


def test_fastqwen_run_is_the_same_file_plus_the_plugin_and_no_multipack():
    a, f = mtc.build("axolotl", **PATHS), mtc.build("fastqwen", **PATHS)
    assert f["plugins"][0] == mtc.FASTQWEN and f["sample_packing"] is False and f["fastqwen_token_budget"] == 8192
    diff = {k for k in set(a) | set(f) if a.get(k) != f.get(k)}
    assert diff == {"plugins", "sample_packing", "fastqwen_token_budget"}
    assert [p for p in f["plugins"] if p != mtc.FASTQWEN] == [p for p in a["plugins"] if p != mtc.FLA_GUARD]


def test_example_plugin_is_axolotls_own_yaml_plus_the_one_line_and_nothing_else():
    """Issue 32's end-to-end pair: Axolotl's 27B example made GPU-ready (bf16 LoRA, its own targets,
    multipack, Axolotl's speed options, Liger for the loss), and the same with only the line."""
    a, f = mtc.build("example", **PATHS), mtc.build("example-plugin", **PATHS)
    assert [p for p in f["plugins"] if p != mtc.FASTQWEN] == a["plugins"] and mtc.FASTQWEN in f["plugins"]
    assert {k for k in set(a) | set(f) if a.get(k) != f.get(k)} == {"plugins"}
    assert a["sample_packing"] is True and a["adapter"] == "lora" and "load_in_4bit" not in a
    assert a["lora_target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj", "down_proj", "up_proj"]
    assert mtc.CCE not in a["plugins"] and mtc.LIGER in a["plugins"] and a["liger_fused_linear_cross_entropy"]
    assert not any(k.startswith("fastqwen_") for k in f)


def test_vision_pair_is_axolotls_vision_example_as_written_and_with_the_line_and_packing():
    """Issue 34's speed pair: the vision example's own batch shape (one sample a micro-step,
    accumulation 4), optimizer and LoRA; the plugin run adds the line and `sample_packing: true`."""
    a, f = mtc.build("vision", **PATHS), mtc.build("vision-plugin", **PATHS)
    assert {k for k in set(a) | set(f) if a.get(k) != f.get(k)} == {"plugins", "sample_packing"}
    assert a["sample_packing"] is False and f["sample_packing"] is True
    assert [p for p in f["plugins"] if p != mtc.FASTQWEN] == a["plugins"] and mtc.FASTQWEN in f["plugins"]
    assert (a["micro_batch_size"], a["gradient_accumulation_steps"], a["sequence_len"], a["lora_r"]) == (1, 4, 8192, 32)
    assert a["processor_type"] == "AutoProcessor" and a["skip_prepare_dataset"] is True
    assert a["optimizer"] == "adamw_bnb_8bit" and a["gradient_checkpointing"] is True
    assert a["datasets"][0]["path"] == "/d.jsonl" and a["datasets"][0]["type"] == "chat_template"
    assert a["attn_implementation"] == "sdpa" and mtc.PROBE in a["plugins"] and mtc.LIGER not in a["plugins"]


@pytest.mark.parametrize("run", ["axolotl", "fastqwen", "qlora", "fft", "example", "example-plugin"])
def test_every_run_gets_the_local_overrides(run):
    cfg = mtc.build(run, **PATHS)
    assert cfg["base_model"] == "/m" and cfg["datasets"][0]["path"] == "/d.jsonl"
    assert cfg["datasets"][0]["ds_type"] == "json" and cfg["datasets"][0]["field_messages"] == "conversations"
    assert (cfg["sequence_len"], cfg["micro_batch_size"], cfg["gradient_accumulation_steps"]) == (8192, 1, 1)
    assert cfg["max_steps"] == 60 and cfg["val_set_size"] == 0 and cfg["save_strategy"] == "no"
    assert "fsdp_config" not in cfg and mtc.PROBE in cfg["plugins"]
    assert cfg["bf16"] is True


def test_safe_variants_drop_only_the_risky_switches():
    cfg = mtc.build("axolotl-safe", **PATHS)
    assert not any(k in cfg for k in mtc.RISKY) and cfg["lora_qkv_kernel"] is True


def test_cpu_rehearsal_switches_cuda_only_things_off():
    cfg = mtc.build("fastqwen", cpu=True, **PATHS)
    assert cfg["bf16"] is False and mtc.LIGER not in cfg["plugins"] and cfg["lora_mlp_kernel"] is False


def test_parse_log_reads_dicts_between_progress_bars():
    text = (
        " 12%|#| 1/8 [00:04<00:34]  {'loss': '6.615', 'grad_norm': '2.878', 'learning_rate': '0', "
        "'tokens/total': 1024, 'epoch': '0.03'}\n"
        "25%|##| 2/8 {'loss': '6.579', 'grad_norm': '1.442', 'learning_rate': '0.0005', 'tokens/total': 2048}\n"
        "{'train_runtime': '28.06', 'train_samples_per_second': '0.57', 'train_steps_per_second': '0.285'}\n"
    )
    parsed = ptl.parse_log(text)
    assert [s["loss"] for s in parsed["steps"]] == [6.615, 6.579]
    assert parsed["final"]["train_runtime"] == 28.06


def test_summary_prefers_the_probes_full_precision_logs(tmp_path):
    run = tmp_path / "fastqwen"
    run.mkdir()
    (run / "train.log").write_text("{'loss': '12.43', 'learning_rate': '1e-4'}\n{'train_runtime': '10.0'}\n")
    probe = {"phases": {"first_step_end": 42.0}, "peak": {"max_alloc_gib": 30.5},
             "steps": [{"step": 1, "dt": None, "slots": 8192, "real_tokens": 8000, "sequences": 9}],
             "logs": [{"step": 1, "loss": 12.4321, "learning_rate": 1e-4}, {"step": 1, "train_runtime": 10.0}]}
    (run / "train_probe.json").write_text(json.dumps(probe))
    (run / "run.json").write_text(json.dumps({"exit_code": 0, "wall_s": 60}))
    s = ptl.summarise_run(run, warmup=5)
    assert s["loss"] == [12.4321] and s["real_tokens_per_s"] == 800.0 and s["sequences_per_s"] == 0.9
    assert s["time_to_first_step_s"] == 42.0 and s["peak_alloc_gib"] == 30.5
    assert "fastqwen" in ptl.markdown([s], "t")
