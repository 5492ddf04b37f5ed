"""Summarise `axolotl train` runs: the Trainer's own log lines, the probe's record, our plugin's report.

Usage: python tools/gpu/parse_train_logs.py RUNS_DIR --json OUT.json --md OUT.md [--png OUT.png]

RUNS_DIR holds one folder per run (the driver's layout): ``train.log`` (stdout + stderr of
``axolotl train``), ``train_probe.json`` (tools/gpu/train_probe.py), optionally
``fastqwen_report.json``, ``config.yml`` and ``run.json`` (exit code, wall time, attempt).

From the Trainer's log dicts (the probe's ``on_log`` copies, full precision; else the printed log
lines, whose values Axolotl rounds to 4 significant digits): per step ``loss``,
``grad_norm``, ``learning_rate``, ``tokens/total`` (cumulative token slots), ``tokens/trainable``,
``tokens/train_per_sec_per_gpu``, ``memory/*``; at the end ``train_runtime``,
``train_samples_per_second``, ``train_steps_per_second``, ``train_loss``. Derived:

* ``slot_tokens_per_s`` = final ``tokens/total`` / ``train_runtime`` (padded row slots);
* ``real_tokens_per_s`` = the probe's non-pad tokens over all steps / ``train_runtime``;
* ``sequences_per_s`` = the probe's sequences (conversations) / ``train_runtime`` (the Trainer's
  ``train_samples_per_second`` counts packed rows: micro-batches x batch size); ``images_per_s``
  likewise from the probe's ``image_grid_thw`` rows (image+text runs);
* ``steady_*``: medians over the steps after the first ``--warmup`` (the Trainer's rate includes
  the first steps' compiling and autotuning);
* wall time to first step and peak memory from the probe;
* for each pair in ``PAIRS`` (the same YAML without and with the plugin line) the ratios of
  ``PAIR_RATIOS``, memory and the loss.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import re
import statistics
from pathlib import Path

DICT_RE = re.compile(r"\{'[^{}]*\}")


def _num(value):
    if isinstance(value, (int, float)):
        return value
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def parse_log(text: str) -> dict:
    steps, final, evals = [], None, []
    for match in DICT_RE.finditer(text):
        try:
            d = ast.literal_eval(match.group(0))
        except (ValueError, SyntaxError):
            continue
        if not isinstance(d, dict):
            continue
        d = {k: _num(v) for k, v in d.items()}
        if "train_runtime" in d:
            final = d
        elif "loss" in d and "learning_rate" in d:
            steps.append(d)
        elif "eval_loss" in d:
            evals.append(d)
    for i, d in enumerate(steps, 1):
        d.setdefault("step", i)
    notes = []
    for line in text.splitlines():
        if re.search(r"fla_hopper_guard: |Hopper guard|is set but left .* stock", line) and len(notes) < 4:
            note = line.strip()[:300]
            if note not in notes:
                notes.append(note)
    errors = [line.strip()[:300] for line in text.splitlines()
              if re.search(r"(Error|Exception|Traceback|OutOfMemory|Killed)", line)
              and not re.search(r"(WARNING|warn|Ignoring)", line)][-8:]
    return {"steps": steps, "final": final, "evals": evals, "error_lines": errors, "notes": notes}


def _median(values):
    values = [v for v in values if isinstance(v, (int, float)) and not math.isnan(v)]
    return statistics.median(values) if values else None


def _r(x, nd=1):
    return None if x is None else round(x, nd)


def summarise_run(run_dir: Path, warmup: int) -> dict:
    name = run_dir.name
    log_path = run_dir / "train.log"
    text = log_path.read_text(errors="replace") if log_path.exists() else ""
    parsed = parse_log(text)
    probe = json.loads((run_dir / "train_probe.json").read_text()) if (run_dir / "train_probe.json").exists() else {}
    meta = json.loads((run_dir / "run.json").read_text()) if (run_dir / "run.json").exists() else {}
    report = None
    if (run_dir / "fastqwen_report.json").exists():
        report = json.loads((run_dir / "fastqwen_report.json").read_text())
    steps, final = parsed["steps"], parsed["final"] or {}
    # The same dicts at full precision, as the probe's on_log got them (the printed lines keep 4 digits)
    plogs = probe.get("logs") or []
    exact = [d for d in plogs if "loss" in d and "learning_rate" in d]
    source = "log lines"
    if exact and len(exact) >= len(steps):
        steps, source = exact, "Trainer logs via the probe's on_log (full precision)"
    final = next((d for d in plogs if "train_runtime" in d), None) or final
    psteps = probe.get("steps", [])
    runtime = final.get("train_runtime")
    out = {
        "run": name,
        "exit_code": meta.get("exit_code"),
        "wall_s": meta.get("wall_s"),
        "attempts": meta.get("attempts"),
        "config": meta.get("config"),
        "steps_logged": len(steps),
        "loss_source": source,
        "train_runtime_s": runtime,
        "train_samples_per_second": final.get("train_samples_per_second"),
        "train_steps_per_second": final.get("train_steps_per_second"),
        "train_loss": final.get("train_loss"),
        "loss": [s.get("loss") for s in steps],
        "grad_norm": [s.get("grad_norm") for s in steps],
        "learning_rate": [s.get("learning_rate") for s in steps],
        "notes": parsed["notes"],
        "error_lines": parsed["error_lines"] if meta.get("exit_code") not in (0, None) or not final else [],
    }
    total_slots = next((s["tokens/total"] for s in reversed(steps) if isinstance(s.get("tokens/total"), (int, float))), None)
    trainable = sum(s["tokens/trainable"] for s in steps if isinstance(s.get("tokens/trainable"), (int, float)))
    if runtime:
        out["slot_tokens_per_s"] = _r(total_slots / runtime) if total_slots else None
        out["trainable_tokens_per_s"] = _r(trainable / runtime) if trainable else None
    real = [s.get("real_tokens") for s in psteps]
    seqs = [s.get("sequences") for s in psteps]
    if runtime and psteps and all(isinstance(v, (int, float)) for v in real):
        out["real_tokens"] = int(sum(real))
        out["sequences"] = int(sum(seqs))
        out["real_tokens_per_s"] = _r(sum(real) / runtime)
        out["sequences_per_s"] = _r(sum(seqs) / runtime, 2)
        out["padding_fraction"] = _r(1 - sum(real) / max(1, sum(s.get("slots") or 0 for s in psteps)), 4)
        images = [s.get("images") for s in psteps]
        if all(isinstance(v, (int, float)) for v in images) and sum(images):
            out["images"] = int(sum(images))
            out["vision_tokens"] = int(sum(s.get("vision_tokens") or 0 for s in psteps))
            out["images_per_s"] = _r(sum(images) / runtime, 2)
    late = [s for s in psteps if s.get("dt") and s["step"] > warmup]
    if late:
        dt = _median([s["dt"] for s in late])
        out["steady_step_s"] = _r(dt, 4)
        tok = _median([s["real_tokens"] for s in late if s.get("real_tokens") is not None])
        if tok and dt:
            out["steady_real_tokens_per_s"] = _r(tok / dt)
            out["steady_tokens_per_s_mean"] = _r(sum(s["real_tokens"] for s in late) / sum(s["dt"] for s in late))
        if all(isinstance(s.get("sequences"), (int, float)) for s in late):
            out["steady_sequences_per_s"] = _r(sum(s["sequences"] for s in late) / sum(s["dt"] for s in late), 2)
        out["step_s"] = [s.get("dt") for s in psteps]
    phases = probe.get("phases", {})
    out["phases_s"] = phases
    out["time_to_first_step_s"] = phases.get("first_step_end")
    peak = probe.get("peak", {})
    out["peak_alloc_gib"] = peak.get("max_alloc_gib")
    out["peak_reserved_gib"] = peak.get("max_reserved_gib")
    if out["peak_alloc_gib"] is None:  # Axolotl's own (rounded) memory logs
        mem = [s.get("memory/max_allocated (GiB)") for s in steps]
        out["peak_alloc_gib"] = max((m for m in mem if isinstance(m, float)), default=None)
    out["device"] = peak.get("device")
    out["versions"] = {k: (v or {}).get("version") for k, v in (probe.get("info", {}).get("versions") or {}).items()}
    if report is not None:
        out["fastqwen_report"] = {k: report.get(k) for k in ("kernels", "fused_cross_entropy", "packing",
                                                             "gated_deltanet_layers", "attention_layers",
                                                             "warnings", "model_class") if k in report}
    return out


def _fmt(x, nd=0):
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:,.{nd}f}"
    return f"{x:,}" if isinstance(x, int) else str(x)


PAIRS = (("axolotl", "fastqwen"), ("example", "example-plugin"), ("vision", "vision-plugin"))  # (without, with)
PAIR_RATIOS = (("real_tokens_per_s", "real tokens/s (train_runtime)"),
               ("steady_real_tokens_per_s", "steady-state real tokens/s"),
               ("sequences_per_s", "sequences/s (train_runtime)"),
               ("steady_sequences_per_s", "steady-state sequences/s"),
               ("images_per_s", "images/s (train_runtime)"))


def _pair_lines(a: dict, f: dict) -> list[str]:
    """The plugin's run `f` against the same YAML without it, `a`: ratios, memory and loss."""
    lines = ["", f"{f['run']} vs {a['run']}:"]
    for key, label in PAIR_RATIOS:
        if a.get(key) and f.get(key):
            lines.append(f"- {label}: {f[key] / a[key]:.2f}x ({_fmt(f[key])} vs {_fmt(a[key])})")
    if a.get("peak_alloc_gib") and f.get("peak_alloc_gib"):
        lines.append(f"- peak allocated: {_fmt(f['peak_alloc_gib'], 1)} GiB vs {_fmt(a['peak_alloc_gib'], 1)} GiB")
    la, lf = [x for x in a["loss"] if isinstance(x, float)], [x for x in f["loss"] if isinstance(x, float)]
    if la and lf:
        k = min(10, len(la), len(lf))
        lines.append(f"- loss, mean of the last {k} logged steps: {f['run']} {sum(lf[-k:]) / k:.4f}, "
                     f"{a['run']} {sum(la[-k:]) / k:.4f} (first step {lf[0]:.4f} / {la[0]:.4f})")
    return lines


def markdown(runs: list[dict], title: str) -> str:
    lines = [f"# {title}", "",
             "| run | exit | steps | train_runtime s | Trainer samples/s (rows) | real tokens/s | sequences/s | "
             "steady tokens/s | steady step s | first step at s | peak alloc GiB | peak reserved GiB | "
             "final loss | wall s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        last = next((v for v in reversed(r["loss"]) if isinstance(v, float)), None)
        lines.append("| " + " | ".join([
            r["run"], _fmt(r["exit_code"]), _fmt(r["steps_logged"]), _fmt(r["train_runtime_s"], 1),
            _fmt(r["train_samples_per_second"], 3), _fmt(r.get("real_tokens_per_s")), _fmt(r.get("sequences_per_s"), 2),
            _fmt(r.get("steady_real_tokens_per_s")), _fmt(r.get("steady_step_s"), 3),
            _fmt(r["time_to_first_step_s"], 1), _fmt(r["peak_alloc_gib"], 1), _fmt(r["peak_reserved_gib"], 1),
            _fmt(last, 4), _fmt(r["wall_s"], 0)]) + " |")
    by = {r["run"].split(".")[0]: r for r in runs}
    for base, plugin in PAIRS:
        a, f = by.get(base) or by.get(f"{base}-safe"), by.get(plugin) or by.get(f"{plugin}-safe")
        if a and f:
            lines += _pair_lines(a, f)
    for r in runs:
        if r.get("notes"):
            lines += ["", f"## {r['run']}: notes from the log", "", *[f"- `{n}`" for n in r["notes"]]]
        if r.get("fastqwen_report"):
            lines += ["", f"## {r['run']}: axolotl_fastqwen load report", "", "```",
                      json.dumps(r["fastqwen_report"], indent=1)[:3000], "```"]
        if r.get("error_lines"):
            lines += ["", f"## {r['run']}: last error lines", "", "```", *r["error_lines"], "```"]
    lines += ["", "Definitions: tools/gpu/parse_train_logs.py (docstring). Versions actually imported:", ""]
    for r in runs:
        if r.get("versions"):
            lines.append(f"- {r['run']}: " + ", ".join(f"{k} {v}" for k, v in r["versions"].items() if v))
    return "\n".join(lines) + "\n"


def plot(runs: list[dict], path: Path, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:  # noqa: BLE001
        return False
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    for r in runs:
        loss = [(i + 1, v) for i, v in enumerate(r["loss"]) if isinstance(v, float)]
        if loss:
            axes[0].plot(*zip(*loss), label=r["run"], lw=1.4)
        st = [(i + 1, v) for i, v in enumerate(r.get("step_s") or []) if isinstance(v, float)]
        if st:
            axes[1].plot(*zip(*st), label=r["run"], lw=1.2)
    axes[0].set(xlabel="optimizer step", ylabel="training loss", title="loss per step")
    axes[1].set(xlabel="optimizer step", ylabel="seconds", title="step wall time (probe)", yscale="log")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs_dir")
    p.add_argument("--json", required=True)
    p.add_argument("--md", required=True)
    p.add_argument("--png")
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the steady-state medians")
    p.add_argument("--title", default=None,
                   help="default: 'axolotl train on one <the runs' GPU>, Qwen3.5-27B-shaped random weights'")
    p.add_argument("--extra", help="a JSON file merged into the summary under 'context'")
    args = p.parse_args(argv)
    runs_dir = Path(args.runs_dir)
    runs = [summarise_run(d, args.warmup) for d in sorted(runs_dir.iterdir())
            if d.is_dir() and ((d / "train.log").exists() or (d / "run.json").exists())]
    summary = {"runs": runs}
    if args.title is None:
        devices = sorted({str(r["device"]) for r in runs if r.get("device")})
        args.title = f"axolotl train on one {' / '.join(devices) or 'GPU'}, Qwen3.5-27B-shaped random weights"
    if args.extra and Path(args.extra).exists():
        summary["context"] = json.loads(Path(args.extra).read_text())
    Path(args.json).write_text(json.dumps(summary, indent=1) + "\n")
    Path(args.md).write_text(markdown(runs, args.title))
    if args.png:
        plot(runs, Path(args.png), args.title)
    print(Path(args.md).read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
