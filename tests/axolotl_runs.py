"""Running Axolotl's own CLI from the tests: one subprocess per command, offline, from the
repository root (where `.assets/` and `examples/` resolve), with the test's interpreter."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OFFLINE = {"AXOLOTL_DO_NOT_TRACK": "1", "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


def axolotl(*args, env_extra=None, timeout=600) -> subprocess.CompletedProcess:
    """`axolotl <args>`; returns the finished process (stdout and stderr captured)."""
    env = dict(os.environ, **OFFLINE)
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "axolotl.cli.main", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def train(path, **kw) -> str:
    """`axolotl train PATH --launcher python`, which must succeed; returns its whole output."""
    run = axolotl("train", str(path), "--launcher", "python", **kw)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    return run.stdout + run.stderr


def fails(*args, **kw) -> str:
    """`axolotl ARGS`, which must fail; returns its whole output (for the message it gave)."""
    run = axolotl(*args, **kw)
    assert run.returncode != 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run.stdout + run.stderr


def report(output_dir: Path) -> dict:
    """The plugin's report of a finished run."""
    return json.loads((Path(output_dir) / "fastqwen_report.json").read_text())


def train_losses(log: str) -> list[float]:
    """The per-step training losses the Trainer logs (`logging_steps: 1`)."""
    return [float(x) for x in re.findall(r"'loss': '?([0-9.]+(?:e-?\d+)?)'?", log)]
