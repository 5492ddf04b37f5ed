"""The five training paths the benchmark compares, each a (batch layout, kernel set-up) pair.

Set-ups are context managers around the same model instance and are fully undone on exit:
stock-torch swaps transformers' kernel globals back to its PyTorch fallbacks, Axolotl's patch is
class-level and its classes and module globals are restored, fastqwen is `patch_model` /
`unpatch_model`. Axolotl runs last anyway, so a restore bug could not leak into another path.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from .. import patch_model, unpatch_model
from ..stock import MODELING_MODULES, resolved_kernel, stock_torch_kernels
from .axolotl_import import import_axolotl_patch


@dataclass(frozen=True)
class PathSpec:
    name: str
    layout: str  # a data.LAYOUTS entry
    summary: str


PATHS: dict[str, PathSpec] = {
    p.name: p
    for p in (
        PathSpec("stock-torch-padded", "padded", "stock transformers on its PyTorch fallback kernels, padded batches"),
        PathSpec("stock-fla-padded", "padded", "stock transformers with the kernels it resolved (fla), padded batches"),
        PathSpec(
            "stock-fla-flattening", "flattening",
            "stock transformers + HF DataCollatorWithFlattening (cu_seq_lens, seq_idx), same rows as the packer",
        ),
        PathSpec(
            "axolotl-packing", "multipack",
            "Axolotl 0.21's Qwen3.5 packing patch + multipack rows (position_ids restart, no start masking)",
        ),
        PathSpec("fastqwen", "packed", "patch_model(model) + PackedBatchSampler / PackedCollator static rows"),
    )
}
# Axolotl's patch is class-level: run it last.
EXECUTION_ORDER = ("stock-torch-padded", "stock-fla-padded", "stock-fla-flattening", "fastqwen", "axolotl-packing")

_AXOLOTL_PATCHES = {
    "qwen3_5": ("axolotl.monkeypatch.models.qwen3_5.modeling", "patch_qwen3_5_modeling_packing"),
    "qwen3_5_moe": ("axolotl.monkeypatch.models.qwen3_5.modeling", "patch_qwen3_5_moe_modeling_packing"),
    "qwen3_next": ("axolotl.monkeypatch.models.qwen3_next.modeling", "patch_qwen3_next_modeling_packing"),
}
STOCK_GLOBALS = ("torch_chunk_gated_delta_rule", "causal_conv1d_fn")


class PathSkipped(Exception):
    """The path cannot run in this environment (not an error of the path itself)."""


def parse_paths(text: str | None) -> list[str]:
    """`--paths a,b` (names or their letters a-e) -> names in execution order."""
    if not text or text == "all":
        return list(EXECUTION_ORDER)
    letters = dict(zip("abcde", PATHS))
    wanted = []
    for item in (t.strip() for t in text.split(",") if t.strip()):
        name = letters.get(item, item)
        if name not in PATHS:
            raise ValueError(f"unknown path {item!r}; known: {', '.join(PATHS)} (or a-e)")
        wanted.append(name)
    return [p for p in EXECUTION_ORDER if p in wanted]


def stock_kernels(family: str) -> dict[str, str]:
    return {name: resolved_kernel(family, name) for name in STOCK_GLOBALS}


@contextlib.contextmanager
def installed(name: str, model: torch.nn.Module, family: str, device: torch.device) -> Iterator[dict]:
    """Set the model up for path `name`; yields an info dict the path's record keeps."""
    info: dict = {"notes": []}
    if name == "stock-torch-padded":
        with stock_torch_kernels(family):
            info["stock_kernels"] = stock_kernels(family)
            yield info
        return
    if name in ("stock-fla-padded", "stock-fla-flattening"):
        info["stock_kernels"] = kernels = stock_kernels(family)
        if device.type != "cuda" and any(v != "torch" for v in kernels.values()):
            info["notes"].append(
                f"transformers resolved {kernels} at import; these are CUDA/Triton kernels and this device is "
                f"{device.type}: the stock forward is expected to crash here"
            )
        if all(v == "torch" for v in kernels.values()):
            info["notes"].append("no fla / causal-conv1d resolved: this path runs the PyTorch fallback")
        if name == "stock-fla-flattening" and kernels.get("causal_conv1d_fn") != "causal_conv1d":
            info["notes"].append(
                "causal_conv1d_fn is not causal-conv1d: the stock torch conv cannot use seq_idx (transformers "
                "5.17 lets its taps read across packed-sequence boundaries: expect a small calibration-loss "
                "difference; 5.20+ raises instead)"
            )
        yield info
        return
    if name == "axolotl-packing":
        with axolotl_patch(family) as note:
            info["notes"].append(note)
            yield info
        return
    if name == "fastqwen":
        report = patch_model(model)
        info["patch_report"] = report
        try:
            if device.type == "cuda":
                _selfcheck_now(report, model)
            print(report.format(), flush=True)
            yield info
        finally:
            info["patch_report"] = report.to_dict()  # after the first forward: includes the self-check
            unpatch_model(model)
        return
    raise ValueError(f"unknown path {name!r}")


def _selfcheck_now(report, model) -> None:
    """Run the plugin's GPU kernel self-check now, before the path's calibration forward, so that
    its kernel runs (and any autotuning they trigger) are not counted in the calibration time."""
    from ..families.base import unwrap
    from ..kernels import selfcheck
    from ..patching import _check_shapes

    with torch.enable_grad():
        selfcheck(report.kernels, _check_shapes(unwrap(model)))


@contextlib.contextmanager
def axolotl_patch(family: str) -> Iterator[str]:
    """Apply Axolotl's class-level packing patch; restore the modeling module exactly afterwards."""
    if family not in _AXOLOTL_PATCHES:
        raise PathSkipped(f"Axolotl has no packing patch for {family}")
    module_name, fn_name = _AXOLOTL_PATCHES[family]
    try:
        patch_module, stood_in = import_axolotl_patch(module_name)
        apply = getattr(patch_module, fn_name)
    except Exception as exc:  # a partial Axolotl install (GPU machine) is expected
        raise PathSkipped(f"import {module_name}.{fn_name} failed: {type(exc).__name__}: {str(exc)[:300]}") from None
    modeling = importlib.import_module(MODELING_MODULES[family])
    saved = _snapshot(modeling)
    try:
        apply()
        changed = _changed(modeling, saved)
        note = f"Axolotl {fn_name}() applied (class-level; changed {', '.join(changed) or 'nothing'}; restored after)"
        if stood_in:
            note += f"; stood in during Axolotl's import (bench/axolotl_import.py): {'; '.join(stood_in)}"
        yield note
    finally:
        _restore(modeling, saved)


def _snapshot(module) -> dict:
    classes = {
        obj: dict(vars(obj))
        for obj in vars(module).values()
        if isinstance(obj, type) and obj.__module__ == module.__name__
    }
    return {"globals": dict(vars(module)), "classes": classes}


def _changed(module, saved: dict) -> list[str]:
    out = [k for k, v in vars(module).items() if saved["globals"].get(k, object()) is not v and not k.startswith("__")]
    for cls, attrs in saved["classes"].items():
        out += [f"{cls.__name__}.{k}" for k, v in vars(cls).items() if attrs.get(k, object()) is not v]
    return out


def _restore(module, saved: dict) -> None:
    for cls, attrs in saved["classes"].items():
        for key in [k for k in vars(cls) if k not in attrs]:
            delattr(cls, key)
        for key, value in attrs.items():
            if key in ("__dict__", "__weakref__"):
                continue
            if vars(cls).get(key, object()) is not value:
                setattr(cls, key, value)
    namespace = vars(module)
    for key in [k for k in namespace if k not in saved["globals"]]:
        del namespace[key]
    for key, value in saved["globals"].items():
        if namespace.get(key, object()) is not value:
            namespace[key] = value
