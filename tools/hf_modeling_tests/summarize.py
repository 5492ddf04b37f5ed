"""Compare a stock and a patched run of transformers' modeling tests (JSON from fastqwen_hf_plugin).

    python tools/hf_modeling_tests/summarize.py OUT_DIR   # reads stock.json + patched.json there

Writes OUT_DIR/summary.json and OUT_DIR/summary.md and prints the Markdown: per family the
passed / failed / skipped / error counts of both runs, and every test that passes stock but not
patched, with its short failure reason and the innermost axolotl_fastqwen frame.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections import Counter

OUTCOMES = ("passed", "failed", "skipped", "error", "xfailed", "xpassed")


def family(nodeid: str) -> str:
    match = re.search(r"tests/models/([^/]+)/", nodeid)
    return match.group(1) if match else "other"


def counts(tests: dict) -> dict[str, dict[str, int]]:
    out: dict[str, Counter] = {}
    for nodeid, entry in tests.items():
        out.setdefault(family(nodeid), Counter())[entry["outcome"] or "unknown"] += 1
    return {fam: {k: c.get(k, 0) for k in OUTCOMES} | {"total": sum(c.values())} for fam, c in sorted(out.items())}


def main(out_dir: str) -> int:
    with open(os.path.join(out_dir, "stock.json")) as f:
        stock = json.load(f)
    with open(os.path.join(out_dir, "patched.json")) as f:
        patched = json.load(f)
    provenance = {}
    prov_path = os.path.join(out_dir, "provenance.json")
    if os.path.exists(prov_path):
        with open(prov_path) as f:
            provenance = json.load(f)

    regressions, fixed, missing = [], [], []
    for nodeid, s in stock["tests"].items():
        p = patched["tests"].get(nodeid)
        if p is None:
            missing.append(nodeid)
            continue
        models = p.get("models", [])
        entry = {
            "test": nodeid,
            "family": family(nodeid),
            "stock": s["outcome"],
            "patched": p["outcome"],
            "reason": p["reason"],
            "where": p["where"],
            "models_patched": sorted({m["class"] for m in models if m.get("patched")}),
        }
        if s["outcome"] == "passed" and p["outcome"] not in ("passed",):
            regressions.append(entry)
        elif s["outcome"] in ("failed", "error") and p["outcome"] == "passed":
            fixed.append(entry)
    not_patched = sorted(
        {m["class"] + ": " + m.get("why", m.get("error", "")) for t in patched["tests"].values()
         for m in t.get("models", []) if not m.get("patched")}
    )
    tests_without_patched_model = sum(
        1 for t in patched["tests"].values() if t["outcome"] == "passed" and not any(m.get("patched") for m in t.get("models", []))
    )
    summary = {
        "transformers": stock.get("transformers"),
        "torch": stock.get("torch"),
        "provenance": provenance,
        "wall_s": {"stock": stock.get("wall_s"), "patched": patched.get("wall_s")},
        "counts": {"stock": counts(stock["tests"]), "patched": counts(patched["tests"])},
        "models_constructed_patched_run": patched.get("models_constructed"),
        "models_left_stock": not_patched,
        "patched_passes_constructing_no_patched_model": tests_without_patched_model,
        "pass_stock_fail_patched": regressions,
        "fail_stock_pass_patched": fixed,
        "missing_in_patched_run": missing,
    }
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    md = render(summary)
    with open(os.path.join(out_dir, "summary.md"), "w") as f:
        f.write(md)
    print(md)
    return 0


def render(s: dict) -> str:
    lines = [f"# transformers {s['transformers']} modeling tests: stock vs axolotl_fastqwen-patched", ""]
    prov = s.get("provenance") or {}
    if prov:
        lines += [f"Test sources: {prov.get('tests_source', '?')}; top-level `tests/*.py` from the PyPI sdist "
                  f"({prov.get('sdist_sha256', '?')[:12]}…)."]
        if prov.get("sdist_overrides"):
            lines += [f"Checkout differs from the sdist in {len(prov['sdist_overrides'])} top-level file(s) "
                      f"(sdist used): {', '.join(prov['sdist_overrides'])}"]
        lines += [""]
    lines += [f"Wall time: stock {s['wall_s']['stock']} s, patched {s['wall_s']['patched']} s.", ""]
    lines += ["| family | run | passed | failed | skipped | error | xfail | total |",
              "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for fam in sorted(set(s["counts"]["stock"]) | set(s["counts"]["patched"])):
        for run in ("stock", "patched"):
            c = s["counts"][run].get(fam, {})
            lines.append(f"| {fam} | {run} | {c.get('passed', 0)} | {c.get('failed', 0)} | {c.get('skipped', 0)} | "
                         f"{c.get('error', 0)} | {c.get('xfailed', 0)} | {c.get('total', 0)} |")
    lines += ["", f"Models constructed in the patched run: {s['models_constructed_patched_run']}."]
    if s["models_left_stock"]:
        lines += ["Left stock (no Gated DeltaNet layer):"] + [f"- {m}" for m in s["models_left_stock"]]
    lines += ["", f"## Pass stock, not patched ({len(s['pass_stock_fail_patched'])})", ""]
    for r in s["pass_stock_fail_patched"]:
        name = r["test"].split("::", 1)[1]
        lines.append(f"- `{r['family']}` `{name}`: {r['patched']} — {r['reason']} (`{shorten(r['where'])}`)")
    if s["fail_stock_pass_patched"]:
        lines += ["", f"## Fail stock, pass patched ({len(s['fail_stock_pass_patched'])})", ""]
        lines += [f"- `{r['test'].split('::', 1)[1]}` (stock {r['stock']})" for r in s["fail_stock_pass_patched"]]
    if s["missing_in_patched_run"]:
        lines += ["", f"Missing from the patched run: {len(s['missing_in_patched_run'])}"]
    return "\n".join(lines) + "\n"


def shorten(where: str) -> str:
    i = where.find("axolotl_fastqwen/")
    if i >= 0:
        return where[i:]
    i = where.find("/tests/")
    return where[i + 1:] if i >= 0 else os.path.basename(where)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "out")))
