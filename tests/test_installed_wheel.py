"""The built wheel, installed beside Axolotl in a fresh environment, trains the tiny demo config.

Runs in the `wheel` matrix cell (tools/noxfile.py), which builds the wheel, installs it with
Axolotl 0.21's pinned stack into an environment of its own and runs this file from outside the
repository: the package that trains is the wheel's, not the source tree's. Anywhere else (the
package imported from the checkout) it skips.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.wheel
ROOT = Path(__file__).resolve().parent.parent


def _installed() -> Path:
    import axolotl_fastqwen

    return Path(axolotl_fastqwen.__file__).resolve().parent


def test_the_wheel_is_what_runs_and_it_trains(tmp_path):
    package = _installed()
    if package == ROOT / "axolotl_fastqwen":
        pytest.skip(f"axolotl_fastqwen is imported from the checkout ({package}); the `wheel` cell runs this")
    assert "site-packages" in package.parts, package
    from tiny_assets import write_assets

    assets = write_assets(ROOT / ".assets")
    cfg = yaml.safe_load((ROOT / "examples" / "tiny-qwen3_5-cpu.yml").read_text())
    cfg.update(base_model=str(assets["qwen3_5"]), output_dir=str(tmp_path / "out"),
               dataset_prepared_path=str(tmp_path / "prepared"), max_steps=3, eval_steps=3, save_strategy="no")
    cfg["datasets"][0]["path"] = str(assets["chat"])
    path = tmp_path / "config.yml"
    path.write_text(yaml.safe_dump(cfg))
    env = dict(os.environ, AXOLOTL_DO_NOT_TRACK="1", WANDB_MODE="disabled", HF_HUB_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONPATH="")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    # `axolotl train` as a user types it, in a folder that holds no source code
    run = subprocess.run(["axolotl", "train", str(path), "--launcher", "python"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    report = json.loads((tmp_path / "out" / "fastqwen_report.json").read_text())
    assert report["kernels"]["family"] == "qwen3_5" and report["packing"]["active"]
    shown = subprocess.run(["axolotl-fastqwen", "report", str(tmp_path / "out")], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0 and "Gated DeltaNet" in shown.stdout, shown.stdout + shown.stderr
