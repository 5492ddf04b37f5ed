"""Shared test setup: offline, deterministic, and a recorder for GPU measurements."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

# the asset builders (tools/tiny_assets.py) live outside the package
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("AXOLOTL_DO_NOT_TRACK", "1")
os.environ.setdefault("WANDB_MODE", "disabled")

_GPU_RECORDS: list[dict] = []


@pytest.fixture
def gpu_record():
    """Append a measurement; written with versions to $FASTQWEN_GPU_RESULTS at session end."""
    return _GPU_RECORDS.append


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get("FASTQWEN_GPU_RESULTS")
    if not path or not _GPU_RECORDS:
        return
    from axolotl_fastqwen.ops.availability import versions

    with open(path, "w") as f:
        json.dump({"versions": versions(), "exitstatus": int(exitstatus), "records": _GPU_RECORDS}, f, indent=2)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the GPU machine: see tools/gpu/README.md)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
