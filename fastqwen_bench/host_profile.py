"""Where the host's time goes in a training step: a sampling profile (pyinstrument) of a few steps of one
path, summed by package and by function.

The torch profiler's GPU kernel time is what the GPU has to do; a step that takes longer waits on the
host (Python, dispatch, kernel launches, or the host itself waiting on the GPU at a sync). pyinstrument
samples the Python stack at a fixed interval, wall clock, and records C functions too (a torch op's
binding, `synchronize`, autograd's engine), at a few percent of overhead: unlike the torch profiler,
which doubles the step of a host-bound path. The profiled steps run after the timed ones, on the same
rows, so the timing is not disturbed. pyinstrument is not needed otherwise (`tools/gpu/README.md`: its
wheel is carried in `.whl/`).
"""

from __future__ import annotations

import collections
from pathlib import Path

INTERVAL_S = 0.0002  # a sample every 0.2 ms: ~2,000 a 0.4 s step
# (package, substring of the file path), first match wins; C functions (`<built-in>`) are their own kind
PACKAGES = (
    ("axolotl_fastqwen", "/axolotl_fastqwen/"),
    ("fastqwen_bench", "/fastqwen_bench/"),
    ("torch.autograd", "/torch/autograd/"),
    ("torch.utils.checkpoint", "/torch/utils/checkpoint"),
    ("torch.nn", "/torch/nn/"),
    ("torch.optim", "/torch/optim/"),
    ("torch (other)", "/torch/"),
    ("triton", "/triton/"),
    ("fla", "/fla/"),
    ("transformers", "/transformers/"),
    ("peft", "/peft/"),
    ("accelerate", "/accelerate/"),
    ("liger_kernel", "/liger_kernel/"),
    ("axolotl", "/axolotl/"),
)
TOP = 30


def available() -> str | None:
    """None if pyinstrument imports, else why not."""
    try:
        import pyinstrument  # noqa: F401
    except ImportError as exc:
        return f"pyinstrument not importable ({exc})"
    return None


def package(file_path: str | None) -> str:
    path = (file_path or "").replace("\\", "/")
    if path == "<built-in>":
        return "C functions"
    for name, marker in PACKAGES:
        if marker in path:
            return name
    return "other Python"


def _self_frames(root):
    """(frame, self seconds) of every frame with time of its own (pyinstrument's `[self]` leaves are
    folded into their parent)."""
    stack = [root]
    while stack:
        frame = stack.pop()
        own = frame.time - sum(c.time for c in frame.children if not c.is_synthetic_leaf)
        if own > 0 and not frame.is_synthetic:
            yield frame, own
        stack.extend(c for c in frame.children if not c.is_synthetic_leaf)


def summarize(root, steps: int) -> dict:
    """Per step: total sampled seconds, self time by package, and the functions with the most self time."""
    by_package: dict[str, float] = collections.Counter()
    by_function: dict[tuple, float] = collections.Counter()
    for frame, own in _self_frames(root):
        kind = package(frame.file_path)
        by_package[kind] += own
        where = "" if kind == "C functions" else f"{frame.file_path_short}:{frame.line_no}"
        by_function[(kind, frame.function, where)] += own
    total = root.time or 1e-12
    return {
        "steps": steps,
        "ms_per_step": round(root.time / steps * 1000, 2),
        "by_package_ms": {k: round(v / steps * 1000, 2) for k, v in sorted(by_package.items(), key=lambda kv: -kv[1])},
        "by_package_share": {k: round(v / total, 4) for k, v in sorted(by_package.items(), key=lambda kv: -kv[1])},
        "top_self": [{"package": k, "function": f, "where": w, "ms_per_step": round(v / steps * 1000, 2)}
                     for (k, f, w), v in sorted(by_function.items(), key=lambda kv: -kv[1])[:TOP]],
    }


def profile_steps(run_step, rows: list, out: Path | None, name: str) -> dict:
    """Run `run_step(row)` for each of `rows` under pyinstrument; write the call tree as text beside the
    bench's outputs (`host_<name>.txt`) and return the summary."""
    from pyinstrument import Profiler

    profiler = Profiler(interval=INTERVAL_S)
    profiler.start()
    try:
        for row in rows:
            run_step(row)
    finally:
        session = profiler.stop()
    summary = summarize(session.root_frame(), len(rows))
    if out is not None:
        path = Path(out) / f"host_{name.replace('+', '_')}.txt"
        path.write_text(profiler.output_text(unicode=False, color=False, show_all=False))
        summary["tree"] = path.name
    return summary


def describe(summary: dict) -> str:
    """The bench.md line: time per step, the packages' shares and the top functions."""
    shares = ", ".join(f"{k} {v:.0%}" for k, v in list(summary["by_package_share"].items())[:6])
    top = "; ".join(f"{t['function']} ({t['package']}) {t['ms_per_step']:.1f} ms" for t in summary["top_self"][:8])
    return (f"host profile (pyinstrument, {summary['steps']} steps after the timed ones, "
            f"{summary['ms_per_step']:.0f} ms a step sampled): {shares}; most self time: {top}")
