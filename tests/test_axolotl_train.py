"""Real `axolotl train` runs (Axolotl 0.21 CLI, subprocess) of tiny models with the plugin.

Each run trains a few steps on CPU from the offline assets and the example YAML; assertions read
the plugin's report (`fastqwen_report.json`, written by its hooks) and the run's log.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytest.importorskip("axolotl")
pytestmark = [pytest.mark.axolotl, pytest.mark.slow]

ROOT = Path(__file__).resolve().parent.parent
ASSETS = ROOT / ".assets"


@pytest.fixture(scope="module", autouse=True)
def assets():
    from axolotl_fastqwen.tools.tiny_assets import write_assets

    write_assets(ASSETS)


def config(tmp_path, example="tiny-qwen3_5-cpu.yml", **overrides):
    cfg = yaml.safe_load((ROOT / "examples" / example).read_text())
    cfg.update(output_dir=str(tmp_path / "out"), dataset_prepared_path=str(tmp_path / "prepared"), max_steps=3,
               eval_steps=3, save_strategy="no")
    for key, value in overrides.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    path = tmp_path / "config.yml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def axolotl(*args, env_extra=None, timeout=600):
    env = dict(os.environ, AXOLOTL_DO_NOT_TRACK="1", WANDB_MODE="disabled", HF_HUB_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "axolotl.cli.main", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def train(path, **kw):
    run = axolotl("train", str(path), "--launcher", "python", **kw)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    return run.stdout + run.stderr


def report(tmp_path):
    return json.loads((tmp_path / "out" / "fastqwen_report.json").read_text())


def test_class_form_patches_packs_and_reports(tmp_path):
    log = train(config(tmp_path))
    r = report(tmp_path)
    kernels, packing = r["kernels"], r["packing"]
    assert kernels["family"] == "qwen3_5"
    assert kernels["layers_patched"] == {"gated_deltanet": 3, "attention": 1}
    assert {op: v["backend"] for op, v in kernels["ops"].items()} == {
        "gated_delta_rule": "torch", "causal_conv": "torch", "gated_rmsnorm": "torch", "varlen_attention": "torch",
        "linear_cross_entropy": "torch-chunked"}
    assert kernels["boundary_sources"] == ["collator"]
    # every training and evaluation batch had the one static shape
    assert kernels["batch_shapes"] == {"train": [[1, 1024]], "eval": [[1, 1024]]}
    assert packing["active"] and packing["row_shape"] == [1, 1024]
    epoch = packing["epochs"][0]
    assert epoch["bins"] < epoch["padded_batches"] and epoch["over_lower_bound_pct"] <= 2.0
    assert "Gated DeltaNet + 1 attention layers patched" in log  # the load-time table is printed
    assert "fastqwen packing:" in log


def test_bare_module_name_works_once_on_qwen3_next(tmp_path):
    path = config(tmp_path, "tiny-qwen3_next-cpu.yml", plugins=["axolotl_fastqwen"])
    log = train(path)
    r = report(tmp_path)
    assert r["kernels"]["family"] == "qwen3_next"
    assert r["kernels"]["layers_patched"] == {"gated_deltanet": 3, "attention": 1}
    assert log.count("Gated DeltaNet + 1 attention layers patched") == 1  # hooks ran once, not per alias


def test_installed_but_not_named_does_nothing(tmp_path):
    # Stock Qwen3.5 layers crash on CPU when fla is importable (transformers picks it there), so
    # this run hides fla: what is checked is that our plugin leaves the run alone.
    shim = tmp_path / "no_fla"
    (shim / "fla").mkdir(parents=True)
    (shim / "fla" / "__init__.py").write_text("raise ImportError('fla hidden for a CPU stock run')\n")
    path = config(tmp_path, plugins=None, sample_packing=False)  # keeps fastqwen_token_budget
    log = train(path, env_extra={"PYTHONPATH": str(shim)})
    assert not (tmp_path / "out" / "fastqwen_report.json").exists()
    assert "layers patched" not in log and "fastqwen packing" not in log
    assert "Plugin loaded successfully: axolotl_fastqwen.FastQwenPlugin" in log  # registered via entry point
    assert "fastqwen_token_budget are ignored" in log  # and says why the user's key does nothing


def test_contradictory_config_fails_at_load_naming_key_and_fix(tmp_path):
    run = axolotl("preprocess", str(config(tmp_path, sample_packing=True)))
    out = run.stdout + run.stderr
    assert run.returncode != 0
    assert "`sample_packing: True`" in out and "set `fastqwen_packing: false`" in out
    assert "Loading model" not in out  # failed at config load, before any model work
