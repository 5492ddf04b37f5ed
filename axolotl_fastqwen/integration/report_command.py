"""`python -m axolotl_fastqwen report CONFIG.yml|OUTPUT_DIR`: print a finished run's plugin report.

Axolotl resolves a relative `output_dir` against the directory `axolotl train` ran in, which this
command cannot know: it looks there (the current directory) and beside the YAML, and says where it
looked when neither holds a report.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..report_text import REPORT_FILE, format_packing, format_report, format_settings


def candidates(target: Path) -> tuple[list[Path], str]:
    """Folders that may hold the report, and how they were derived (for the message)."""
    if not target.is_file():
        return [target], f"{target} (given as the output_dir)"
    import yaml

    cfg = yaml.safe_load(target.read_text()) or {}
    output_dir = cfg.get("output_dir")
    if not output_dir:
        return [], f"{target} sets no output_dir"
    out = Path(output_dir)
    if out.is_absolute():
        return [out], f"{out} (output_dir of {target})"
    cwd, beside = Path.cwd() / out, target.resolve().parent / out
    folders = list(dict.fromkeys([cwd, beside]))
    return folders, (f"{cwd} (output_dir {output_dir!r} of {target}, against the current directory) and {beside} "
                     "(against the YAML's folder)" if len(folders) > 1 else f"{cwd} (output_dir of {target})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="axolotl-fastqwen report", description=__doc__.split("\n")[0])
    parser.add_argument("target", help="the Axolotl YAML of the run, or its output_dir")
    args = parser.parse_args(argv)
    target = Path(args.target)
    if not target.exists():
        print(f"{target} does not exist: give the run's YAML or its output_dir")
        return 1
    folders, looked = candidates(target)
    path = next((f / REPORT_FILE for f in folders if (f / REPORT_FILE).exists()), None)
    if path is None:
        print(f"no {REPORT_FILE} in {looked}. The plugin writes it once the trainer is built; was the run "
              "started from that directory, did it get that far, and was `axolotl_fastqwen` in its `plugins:`?")
        return 1
    data = json.loads(path.read_text())
    print(f"{path}:")
    checkpointing = data.get("checkpointing") or {}
    for line in format_settings(data.get("settings") or {}):
        print(line)
    if data.get("kernels"):
        print(format_report(data["kernels"], checkpointing))
        shapes = data["kernels"].get("batch_shapes") or {}
        print(f"  batch shapes seen: train {shapes.get('train')}, eval {shapes.get('eval')}")
    for line in format_packing(data.get("packing") or {}):
        print(line)
    if checkpointing.get("mode") == "auto":
        print(f"checkpointing (auto): {checkpointing.get('summary', 'not started')}")
    return 0
