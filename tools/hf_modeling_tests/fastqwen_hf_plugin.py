"""pytest plugin: run transformers' own Qwen hybrid modeling tests stock or patched.

Loaded with `-p fastqwen_hf_plugin` (this folder on PYTHONPATH) by `run.sh`:

    --fastqwen-mode=stock    transformers' PyTorch kernel fallbacks forced for the whole session
                             (`axolotl_fastqwen.transformers_functions.stock_torch_kernels`): fla is importable here
                             and its Triton kernels crash on CPU.
    --fastqwen-mode=patched  the same, and every model of the qwen3_5 / qwen3_5_moe / qwen3_next
                             modeling modules that a test constructs (directly, `_from_config`,
                             `from_pretrained`, `AutoModel*`, ...) gets `patch_model(model)` as its
                             outermost `__init__` returns. Models without a Gated DeltaNet layer
                             (`UnsupportedModelError`, e.g. the vision tower alone, or a config whose
                             `layer_types` are all attention) stay stock and are counted.
    --fastqwen-results=PATH  JSON: every test's outcome, short reason, duration and the models it
                             constructed (patched / left stock and why).

Models of any other class are never touched. The stock forward of a patched layer is not called.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
import threading
import time

import pytest

FAMILY_MODULES = (
    "transformers.models.qwen3_5.modeling_qwen3_5",
    "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe",
    "transformers.models.qwen3_next.modeling_qwen3_next",
)

_state = threading.local()
_events: list[dict] = []  # models constructed during the current test
_results: dict[str, dict] = {}
_totals = {"patched": 0, "unsupported": 0, "patch_error": 0}
_wrapped: list[tuple[type, object, bool]] = []
_stack = contextlib.ExitStack()


def pytest_addoption(parser):
    group = parser.getgroup("fastqwen")
    group.addoption("--fastqwen-mode", choices=("stock", "patched"), default="stock")
    group.addoption("--fastqwen-results", default=None, help="where to write the per-test JSON")


def _depth() -> int:
    return getattr(_state, "depth", 0)


def _patch_constructed(model) -> None:
    from axolotl_fastqwen import patch_model
    from axolotl_fastqwen.families import UnsupportedModelError

    name = type(model).__name__
    try:
        report = patch_model(model)
    except UnsupportedModelError as exc:
        _totals["unsupported"] += 1
        _events.append({"class": name, "patched": False, "why": str(exc).split(";")[0]})
        return
    except Exception as exc:  # a user would hit this too: record it and let the test fail
        _totals["patch_error"] += 1
        _events.append({"class": name, "patched": False, "error": f"{type(exc).__name__}: {exc}"})
        raise
    _totals["patched"] += 1
    _events.append({
        "class": name,
        "patched": True,
        "gated_deltanet": report.gated_deltanet_layers,
        "attention": report.attention_layers,
        "cross_entropy": report.fused_cross_entropy,
    })


def _wrap_init(cls: type) -> None:
    original = cls.__dict__.get("__init__")
    inherited = cls.__init__

    @functools.wraps(inherited)
    def __init__(self, *args, **kwargs):
        _state.depth = _depth() + 1
        try:
            inherited(self, *args, **kwargs)
        finally:
            _state.depth -= 1
        # the outermost model only: its sub-models (the text decoder of a VLM, the base model of a
        # *ForCausalLM) are patched as part of it, exactly as `patch_model(model)` does for a user
        if _depth() == 0 and type(self).__module__ in FAMILY_MODULES:
            _patch_constructed(self)

    __init__._fastqwen_hf_wrapper = True
    cls.__init__ = __init__
    _wrapped.append((cls, original, original is not None))


def _install_patching() -> int:
    import importlib

    from transformers import PreTrainedModel

    count = 0
    for module_name in FAMILY_MODULES:
        module = importlib.import_module(module_name)
        for value in list(vars(module).values()):
            if (isinstance(value, type) and issubclass(value, PreTrainedModel)
                    and value.__module__ == module_name):
                _wrap_init(value)
                count += 1
    return count


def _uninstall_patching() -> None:
    for cls, original, had_own in reversed(_wrapped):
        if had_own:
            cls.__init__ = original
        else:
            del cls.__init__
    _wrapped.clear()


def pytest_configure(config):
    from axolotl_fastqwen.transformers_functions import stock_torch_kernels

    config._fastqwen_mode = config.getoption("--fastqwen-mode")
    _stack.enter_context(stock_torch_kernels())
    config._fastqwen_wrapped = _install_patching() if config._fastqwen_mode == "patched" else 0
    config._fastqwen_started = time.time()


def pytest_unconfigure(config):
    _uninstall_patching()
    _stack.close()


def pytest_report_header(config):
    import transformers

    return (f"fastqwen mode: {config._fastqwen_mode} (stock PyTorch kernel fallbacks forced; "
            f"{config._fastqwen_wrapped} model classes wrapped); transformers {transformers.__version__}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _events.clear()
    yield


def _short(report) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None:
        text = crash.message
    elif isinstance(report.longrepr, tuple):  # skip: (path, line, reason)
        text = str(report.longrepr[2])
    else:
        text = str(report.longrepr)
    text = text.strip().splitlines()[0] if text.strip() else ""
    return text[:400]


def _where(report) -> str:
    """The innermost traceback entry inside axolotl_fastqwen, else the last one (file:line)."""
    entries = getattr(getattr(report.longrepr, "reprtraceback", None), "reprentries", None) or []
    located = []
    for entry in entries:
        loc = getattr(entry, "reprfileloc", None)
        if loc is not None:
            located.append(f"{loc.path}:{loc.lineno}")
    ours = [loc for loc in located if "axolotl_fastqwen" in loc]
    return (ours or located or [""])[-1]


def pytest_runtest_logreport(report):
    entry = _results.setdefault(report.nodeid, {"outcome": None, "reason": "", "where": "", "duration": 0.0})
    if type(report).__name__ == "SubtestReport":  # pytest's subtests (unittest `subTest`): tallied apart
        tally = entry.setdefault("subtests", {})
        tally[report.outcome] = tally.get(report.outcome, 0) + 1
        if report.failed:
            entry.setdefault("subtest_failures", []).append(
                {"context": str(getattr(report, "context", ""))[:200], "reason": _short(report), "where": _where(report)})
        return
    entry["duration"] = round(entry["duration"] + report.duration, 3)
    if report.when == "call":
        if hasattr(report, "wasxfail"):
            entry["outcome"] = "xfailed" if report.skipped else "xpassed"
            entry["reason"] = str(report.wasxfail)[:400]
        else:
            entry["outcome"] = report.outcome
            if not report.passed:
                entry["reason"], entry["where"] = _short(report), _where(report)
    elif report.failed:  # setup / teardown error
        entry["outcome"] = "error"
        entry["reason"], entry["where"] = f"[{report.when}] " + _short(report), _where(report)
    elif report.skipped and entry["outcome"] is None:
        entry["outcome"] = "skipped"
        entry["reason"] = _short(report)
    if report.when == "teardown":
        entry["models"] = list(_events)
        failures = entry.get("subtest_failures")
        if failures and entry["outcome"] == "passed":  # a failed subtest fails its test
            entry["outcome"] = "failed"
            entry["reason"], entry["where"] = "[subtest] " + failures[0]["reason"], failures[0]["where"]


def pytest_sessionfinish(session, exitstatus):
    path = session.config.getoption("--fastqwen-results")
    if not path:
        return
    import torch
    import transformers

    from axolotl_fastqwen.ops.availability import versions

    payload = {
        "mode": session.config._fastqwen_mode,
        "exitstatus": int(exitstatus),
        "wall_s": round(time.time() - session.config._fastqwen_started, 1),
        "argv": sys.argv[1:],
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "versions": versions(),
        "torch_threads": torch.get_num_threads(),
        "models_constructed": dict(_totals),
        "tests": _results,
    }
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=1, sort_keys=False)
