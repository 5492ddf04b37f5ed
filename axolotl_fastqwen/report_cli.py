"""`python -m axolotl_fastqwen report CONFIG.yml|OUTPUT_DIR`: print a finished run's plugin report."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .patching import format_report
from .plugin import REPORT_FILE


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="axolotl-fastqwen report", description=__doc__)
    parser.add_argument("target", help="the Axolotl YAML of the run, or its output_dir")
    args = parser.parse_args(argv)
    target = Path(args.target)
    if target.is_file():
        import yaml

        target = Path(yaml.safe_load(target.read_text())["output_dir"])
    path = target / REPORT_FILE
    if not path.exists():
        print(f"no {REPORT_FILE} in {target}: was `axolotl_fastqwen` in the run's `plugins:`?")
        return 1
    data = json.loads(path.read_text())
    if data.get("kernels"):
        print(format_report(data["kernels"]))
        shapes = data["kernels"].get("batch_shapes") or {}
        print(f"  batch shapes seen: train {shapes.get('train')}, eval {shapes.get('eval')}")
    packing = data.get("packing") or {}
    if packing.get("active"):
        for i, e in enumerate(packing["epochs"]):
            print(
                f"packing, epoch {i}: {e['samples']:,} samples, {e['real_tokens']:,} tokens -> {e['bins']:,} rows of "
                f"{packing['token_budget']} (lower bound {e['lower_bound']:,}), padding "
                f"{100 * e['padding_fraction']:.1f}%, {e['reduction_vs_padded_pct']:.1f}% fewer steps than "
                f"{e['padded_batches']:,} padded batches of {e['micro_batch_size']}"
            )
    else:
        print("packing: not active (fastqwen_packing: false)")
    return 0
