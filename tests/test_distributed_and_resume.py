"""Data parallelism and checkpoints, through Axolotl's own train command on CPU.

* 2 ranks (torchrun, gloo): disjoint samples, union = the dataset, equal step counts, the same
  bins as one process, and every micro-batch's loss on every rank (and in the single process)
  equal to stock transformers run on that batch's sequences one at a time, over the
  `num_items_in_batch` the model was given (lr = 0 and LoRA's B = 0, so the trained model is the
  checkpoint; fp32, tolerance 1e-5 relative: the same math in another order).
* Resume mid-epoch (in the second epoch): the samples and the losses of the interrupted + resumed
  run are one uninterrupted run's, step by step; and the checkpoint resumes without the plugin.
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
TESTS = Path(__file__).resolve().parent
PLUGINS = ["axolotl_fastqwen.FastQwenPlugin", "fastqwen_probe.ProbePlugin"]


@pytest.fixture(scope="module", autouse=True)
def assets():
    from tiny_assets import write_assets

    write_assets(ROOT / ".assets")


def config(tmp_path, name, **overrides):
    cfg = yaml.safe_load((ROOT / "examples" / "tiny-qwen3_5-cpu.yml").read_text())
    for key in ("max_steps", "eval_steps"):
        cfg.pop(key, None)
    cfg.update(output_dir=str(tmp_path / name), dataset_prepared_path=str(tmp_path / "prepared"), num_epochs=1,
               val_set_size=0, save_strategy="no", plugins=PLUGINS, learning_rate=0.0)
    for key, value in overrides.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    path = tmp_path / f"{name}.yml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def env(**extra):
    e = dict(os.environ, AXOLOTL_DO_NOT_TRACK="1", WANDB_MODE="disabled", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
             TRANSFORMERS_OFFLINE="1", PYTHONPATH=f"{TESTS}{os.pathsep}{extra.pop('PYTHONPATH', '')}")
    e.update(extra)
    return e


def run(cmd, **extra):
    done = subprocess.run(cmd, cwd=ROOT, env=env(**extra), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return done.stdout + done.stderr


def train(path, **extra):
    return run([sys.executable, str(TESTS / "axolotl_cpu_ranks.py"), str(path)], **extra)


def probe(out: Path) -> list[dict]:
    rows = [json.loads(line) for f in sorted(out.glob("probe-rank*.jsonl")) for line in f.read_text().splitlines()]
    return sorted(rows, key=lambda r: (r["step"], r["rank"]))


def stock_losses(rows: list[dict]) -> list[float]:
    """Each recorded micro-batch's loss by stock transformers: its sequences one at a time on the
    checkpoint the run started from, summed, over the batch's own num_items_in_batch."""
    import torch
    from transformers import AutoModelForCausalLM

    from axolotl_fastqwen.transformers_functions import stock_torch_kernels

    model = AutoModelForCausalLM.from_pretrained(ROOT / ".assets" / "qwen3_5", dtype=torch.float32).eval()
    out = []
    with stock_torch_kernels("qwen3_5"), torch.no_grad():
        for row in rows:
            total = 0.0
            for ids, labels in row["segments"]:
                loss = model(input_ids=torch.tensor([ids]), labels=torch.tensor([labels]),
                             num_items_in_batch=torch.tensor(1), use_cache=False).loss
                total += float(loss)
            out.append(total / row["num_items_in_batch"])
    return out


def assert_losses_are_stock(rows: list[dict]) -> None:
    for row, expected in zip(rows, stock_losses(rows)):
        assert abs(row["loss"] - expected) <= 1e-5 * abs(expected), (row["step"], row["rank"], row["loss"], expected)


def test_two_ranks_train_disjoint_bins_that_cover_the_dataset(tmp_path):
    ddp = config(tmp_path, "ddp")
    single = config(tmp_path, "single")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(TESTS / "axolotl_cpu_ranks.py")]
    train(single)  # first: it also prepares the dataset both runs share (ranks then only load it)
    run([*torchrun, str(ddp)])
    ranks, alone = probe(tmp_path / "ddp"), probe(tmp_path / "single")

    seen = {r: [s for row in ranks if row["rank"] == r for s in row["seqs"]] for r in (0, 1)}
    everything = [s for row in alone for s in row["seqs"]]
    assert not set(seen[0]) & set(seen[1])  # disjoint
    assert sorted(seen[0] + seen[1]) == sorted(everything)  # together: the whole dataset, once
    assert len(everything) == len(set(everything))
    steps = {r: [row["step"] for row in ranks if row["rank"] == r] for r in (0, 1)}
    assert steps[0] == steps[1] and len(steps[0]) > 1  # equal step counts: no rank waits at a collective

    report = json.loads((tmp_path / "ddp" / "fastqwen_report.json").read_text())
    assert report["packing"]["replicas"] == 2
    assert {tuple(row["seqs"]) for row in ranks} == {tuple(row["seqs"]) for row in alone}  # the same bins
    assert_losses_are_stock(ranks)  # the reference: stock on each sequence, not the plugin's own run
    assert_losses_are_stock(alone)


def test_resume_mid_epoch_replays_nothing_and_skips_nothing(tmp_path):
    common = dict(num_epochs=2, learning_rate=1e-3, save_strategy="steps", save_steps=20)
    full = config(tmp_path, "full", **common)
    train(full)
    reference = probe(tmp_path / "full")
    steps = len(reference)
    assert steps > 40, steps  # a checkpoint in the second epoch exists

    resumed = config(tmp_path, "resumed", **common, resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-40"))
    train(resumed)
    second = probe(tmp_path / "resumed")
    assert [r["step"] for r in second] == list(range(40, steps))
    combined = [r["seqs"] for r in reference if r["step"] < 40] + [r["seqs"] for r in second]
    assert combined == [r["seqs"] for r in reference]  # same bins, same order, each sample once per epoch
    # and the same training: after the resume, each step's loss is the uninterrupted run's
    # (weights, optimizer state and schedule restored from the checkpoint; fp32, 1e-5 relative)
    after = [r for r in reference if r["step"] >= 40]
    assert len(after) == len(second)
    for a, b in zip(second, after):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"]), (a["step"], a["loss"], b["loss"])

    # The plugin's checkpoint is a plain Axolotl/PEFT checkpoint: it resumes without the plugin.
    # (Stock Qwen3.5 layers crash on CPU when fla is importable, so this run hides fla.)
    shim = tmp_path / "no_fla" / "fla"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text("raise ImportError('fla hidden for a CPU stock run')\n")
    stock = config(tmp_path, "stock", **common, plugins=None, fastqwen_token_budget=None, max_steps=42,
                   sample_packing=False,  # Axolotl's multipack needs fla's kernels, hidden here
                   resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-40"))
    train(stock, PYTHONPATH=str(shim.parent))
    assert (tmp_path / "stock" / "adapter_model.safetensors").exists()
