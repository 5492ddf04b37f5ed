"""Overlay the loss curves of `tools/gpu/fp8_loss_pair.py` runs (issue 35's proof of the loss): each
variant's loss per step (a 10-step running mean) and, below, its difference from bf16's, with the
last-100-step window shaded. Runs of other files join with a label (`file.json:variant=label`).

  python3 tools/gpu/plot_fp8_loss.py benchmarks/h100/2026-12-06d/fp8_loss_8layers_converged_call3.json \
      --out benchmarks/h100/2026-12-06d/fp8_loss_8layers_converged.png
Needs matplotlib and numpy (not in the package's dependencies).
"""

from __future__ import annotations

import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

SMOOTH = 10


def running_mean(values: list[float], width: int = SMOOTH) -> np.ndarray:
    v = np.asarray(values, dtype=float)
    kernel = np.ones(width) / width
    return np.convolve(v, kernel, mode="valid")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("result", help="fp8_loss.json: its bf16 run is the reference")
    p.add_argument("--extra", action="append", default=[], help="file.json:variant=label, another run to overlay")
    p.add_argument("--title", default=None)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    result = json.loads(open(args.result).read())
    runs = {k: v["losses"] for k, v in result.items() if isinstance(v, dict) and "losses" in v}
    for item in args.extra:
        path, rest = item.split(":", 1)
        variant, label = rest.split("=", 1)
        runs[label] = json.loads(open(path).read())[variant]["losses"]
    reference = np.asarray(runs["bf16"])
    steps = len(reference)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    x = np.arange(SMOOTH - 1, steps)
    for i, (label, losses) in enumerate(runs.items()):
        losses = np.asarray(losses[:steps])
        tail = losses[-100:].mean()
        color = f"C{i}"  # the same colour in both panels
        top.plot(x, running_mean(losses), label=f"{label} (last 100: {tail:.4f})", lw=1.4, color=color)
        if label != "bf16":
            gap = tail - reference[-100:].mean()
            bottom.plot(x, running_mean(losses - reference), label=f"{label} - bf16 (last 100: {gap:+.4f})", lw=1.2,
                        color=color)
    for ax in (top, bottom):
        ax.axvspan(steps - 100, steps, color="0.9", zorder=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="best", framealpha=0.9)
    bottom.axhline(0.0, color="k", lw=0.8)
    bottom.axhspan(-0.01, 0.01, color="tab:green", alpha=0.15, zorder=0)
    top.set_ylabel(f"loss ({SMOOTH}-step mean)")
    bottom.set_ylabel("difference from bf16")
    bottom.set_xlabel("step")
    a = result["args"]
    top.set_title(args.title or f"{a['model']}, {result['layers']} layers, LoRA r=16, lr {a['lr']}, {steps} steps "
                  f"({result['gpu']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
