"""`python -m fastqwen_bench profile`: where one path's step time goes.

torch.profiler around N training steps (after warm-up) of one path; writes a Chrome trace and
prints the top kernels by GPU time, launches per step, GPU kernel time by category (GEMM,
elementwise/copy, GDN, conv, attention, norms, loss, optimizer; MoE models add router and experts),
the GPU's idle gaps (consecutive kernels further apart than --gap-us) with the CPU op that was
running at the time: the host-side work (syncs, Python, launch overhead) that starves the GPU, and
the launch census: kernels per step by the chain of CPU ops that issued them (the op that launched
the kernel and its callers up to the nearest autograd function or module), which is where
launches per token are won or lost.

Categories come from kernel names alone (`CATEGORY_RULES`, first match wins): a heuristic, but
one that reads the names the libraries give their kernels (fla's `chunk_*`, Liger's
`liger_*`/`element_mul`, ScatterMoE's `scatter2scatter`, cuBLAS' `nvjet`/`gemm`, ...). What no rule
matches is counted as "other" and listed, so a misfiled kernel can be seen.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import contextlib
import gzip
import json
import os
import re
import shutil
import time

import torch

from axolotl_fastqwen.memory.checkpoint_fitter import FIT_STEPS, CheckpointFitter, memory_of
from fastqwen_bench import data, measure
from fastqwen_bench.paths import CHECKPOINTING_AUTO, PATHS, PathSkipped, installed
from fastqwen_bench.run import add_common_args, environment, log, prepare, train_step

GZIP_ABOVE_BYTES = 32 * 2**20
RUNTIME_KINDS = ("cuda_runtime", "cuda_driver")


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m fastqwen_bench profile", description=__doc__.split("\n")[0])
    add_common_args(p)
    p.set_defaults(steps=3)
    p.add_argument("--path", default="fastqwen", choices=list(PATHS), help="the path to profile")
    p.add_argument("--out", default="outputs/fastqwen-profile", help="output folder (trace.json[.gz], profile.json)")
    p.add_argument("--gap-us", type=float, default=50.0, help="GPU idle gaps longer than this are reported")
    p.add_argument("--top", type=int, default=20, help="rows of the kernel / gap tables")
    p.add_argument("--census-rows", type=int, default=60, help="rows of the launch census table")
    p.add_argument("--no-trace", dest="trace", action="store_false",
                   help="write profile.json only (a 64-layer trace is tens of MB even gzipped)")
    return p


# (category, regex on the lower-cased kernel name); first match wins. MoE-only categories first so
# that ScatterMoE's / grouped-mm kernels are not counted as dense GEMMs or elementwise work.
CATEGORY_RULES: tuple[tuple[str, str], ...] = (
    ("optimizer", r"multi_tensor_apply|fused_adam|adamw|_adam_|foreach_.*(lerp|addcdiv|sqrt)"),
    ("loss", r"cross_entropy|liger_cross|element_mul_kernel|cce_|lse_|nll_loss|log_softmax|logsumexp"),
    ("experts", r"scatter2scatter|groupxty|group_bwd|scattermoe|grouped_mm|groupedgemm|grouped_gemm|"
                r"ptr_array|histc|moe_|_experts|bincount|radixsort|sort_kernel|index_add|scatter_add"),
    ("router", r"topk|softmax(?!.*(fmha|flash|attn|attention))"),
    ("gdn", r"chunk_|solve_tril|recompute_w_u|wy_repr|l2norm|delta_rule|kkt|fused_recurrent|merge_16x16|"
            r"chunk_local_cumsum"),
    ("conv", r"causal_conv|conv1d|conv_depthwise|depthwise|convolution"),
    ("attention", r"flash|fmha|attention|attn|sdpa|varlen|cutlass.*mha|_efficient_"),
    ("norms", r"rms_norm|rmsnorm|layer_norm|layernorm|norm_fwd|norm_bwd|rms_norm_rope|_norm_kernel|"
              r"gated_norm|norm_gated"),
    ("gemm", r"gemm|nvjet|xmma|cublas|cutlass|sm90_|sm80_|matmul|splitk|gemv|_mm_|addmm"),
    ("elementwise/copy", r"elementwise|vectorized|copy|unrolled|reduce|fill|catarray|cat_|index|gather|"
                         r"scatter|memcpy|memset|triu|tril|where|clamp|pow|mul|add|sigmoid|silu|exp|"
                         r"cumsum|arange|embedding|masked|transpose|permute|compare|bitwise|cast|_to_"),
)
MOE_CATEGORIES = ("router", "experts")


def categorize(name: str, moe: bool = True) -> str:
    """The category of a kernel, from its name (see CATEGORY_RULES)."""
    low = name.lower()
    for category, pattern in CATEGORY_RULES:
        if category in MOE_CATEGORIES and not moe:
            continue
        if re.search(pattern, low):
            return category
    return "other"


def categories(by_name: dict[str, list[float]], steps: int, moe: bool) -> dict:
    """GPU kernel time per step by category, with each category's top kernels."""
    total = sum(sum(v) for v in by_name.values()) or 1.0
    out: dict = {}
    for name, durations in by_name.items():
        c = out.setdefault(categorize(name, moe), {"ms_per_step": 0.0, "launches_per_step": 0.0, "kernels": []})
        c["ms_per_step"] += sum(durations) / steps / 1000
        c["launches_per_step"] += len(durations) / steps
        c["kernels"].append((sum(durations), name))
    for c in out.values():
        c["share"] = round(c["ms_per_step"] * steps * 1000 / total, 4)
        c["ms_per_step"] = round(c["ms_per_step"], 3)
        c["launches_per_step"] = round(c["launches_per_step"], 1)
        c["kernels"] = [n[:120] for _, n in sorted(c["kernels"], reverse=True)[:5]]
    return dict(sorted(out.items(), key=lambda kv: -kv[1]["ms_per_step"]))


def _name(event) -> str:
    return measure._field(event, "name", "") or ""


def _kind(event) -> str:
    return str(measure._field(event, "activity_type", "") or "")


def analyze(events, steps: int, gap_us: float, top: int, moe: bool = False) -> dict:
    """Kernel table, time by category, launches per step and GPU idle gaps (attributed to the
    innermost CPU op)."""
    kernels = sorted((e for e in events if measure.is_kernel(e)), key=measure.start_us)
    by_name: dict[str, list[float]] = collections.defaultdict(list)
    for k in kernels:
        by_name[_name(k)].append(measure.duration_us(k))
    gpu_us = sum(sum(v) for v in by_name.values())
    table = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]
    out = {
        "kernels": len(kernels),
        "launches_per_step": round(len(kernels) / steps, 1),
        "gpu_kernel_ms_per_step": round(gpu_us / steps / 1000, 2),
        "top_kernels": [
            {"name": n[:160], "calls": len(v), "total_ms": round(sum(v) / 1000, 3),
             "avg_us": round(sum(v) / len(v), 1), "share": round(sum(v) / gpu_us, 4) if gpu_us else 0.0}
            for n, v in table
        ],
        "categories": categories(by_name, steps, moe),
        "category_rules": {c: p for c, p in CATEGORY_RULES if moe or c not in MOE_CATEGORIES},
    }
    if not kernels:
        return out
    window = measure.start_us(kernels[-1]) + measure.duration_us(kernels[-1]) - measure.start_us(kernels[0])
    out["gpu_window_ms"] = round(window / 1000, 2)
    out["gpu_busy_fraction"] = round(gpu_us / window, 4) if window else None
    cpu = sorted(
        ((measure.start_us(e), measure.start_us(e) + measure.duration_us(e), _name(e), _kind(e))
         for e in events if not measure.is_device_event(e) and measure.duration_us(e) > 0),
        key=lambda x: x[0],
    )
    starts = [c[0] for c in cpu]
    gaps = collections.defaultdict(lambda: {"count": 0, "total_us": 0.0, "runtime": collections.Counter()})
    total_gap, end = 0.0, measure.start_us(kernels[0]) + measure.duration_us(kernels[0])
    for k in kernels[1:]:
        start = measure.start_us(k)
        gap = start - end
        if gap > gap_us:
            total_gap += gap
            op, runtime = _active(cpu, starts, end + min(gap / 2, 20.0))
            g = gaps[op]
            g["count"] += 1
            g["total_us"] += gap
            if runtime:
                g["runtime"][runtime] += 1
        end = max(end, start + measure.duration_us(k))
    out["gap_threshold_us"] = gap_us
    out["idle_gaps_ms_per_step"] = round(total_gap / steps / 1000, 2)
    out["idle_gaps"] = [
        {"cpu_op": op[:160], "count": g["count"], "total_ms": round(g["total_us"] / 1000, 3),
         "ms_per_step": round(g["total_us"] / steps / 1000, 3),
         "runtime_call": g["runtime"].most_common(1)[0][0] if g["runtime"] else None}
        for op, g in sorted(gaps.items(), key=lambda kv: -kv[1]["total_us"])[:top]
    ]
    return out


CENSUS_DEPTH = 5  # ops in a census key at most: the launching op and its callers
# aten ops that only make views or allocate: no kernel on a GPU, so not a launch in a CPU census
_NO_KERNEL = re.compile(
    r"^aten::(view|_?reshape_alias|reshape|_unsafe_view|as_strided|expand|expand_as|transpose|t|permute|select|"
    r"slice|unsqueeze|squeeze|split|split_with_sizes|chunk|narrow|unbind|detach|alias|empty|empty_strided|"
    r"empty_like|resolve_conj|resolve_neg|lift_fresh|contiguous|to|_to_copy|result_type|movedim|flatten|"
    r"unflatten|view_as|numpy_T|matrix_H|lift|_local_scalar_dense|item)$"
)


def _cpu_launches(e) -> bool:
    """CPU census: an aten op that would launch a kernel itself (none of its callees does)."""
    name = str(getattr(e, "name", ""))
    if not name.startswith("aten::") or _NO_KERNEL.match(name):
        return False
    stack = list(getattr(e, "cpu_children", None) or [])
    while stack:
        child = stack.pop()
        if str(child.name).startswith("aten::") and not _NO_KERNEL.match(child.name):
            return False
        stack.extend(child.cpu_children or [])
    return True


def launch_census(function_events, steps: int, top: int, moe: bool = False) -> list[dict]:
    """Kernels per step grouped by the chain of CPU ops that launched them.

    `function_events` are torch.profiler FunctionEvents (`prof.events()`): each CPU op lists the
    device kernels it launched (`.kernels`) and its caller (`.cpu_parent`). The key is the
    launching op, its aten callers and the first caller that is not an aten op: the autograd
    function (forward record or backward node), module or record_function that owns the launch.
    On a CPU-only run there are no kernels; each aten op that would launch one (not a view or an
    allocation, no callee that launches) counts instead, so the table still shows a step's makeup."""
    events = list(function_events)
    on_device = any(getattr(e, "kernels", None) for e in events)
    rows: dict[tuple[str, ...], dict] = {}
    for e in events:
        launched = list(getattr(e, "kernels", None) or [])
        if not launched:
            if on_device or not _cpu_launches(e):
                continue
            launched = [None]
        chain, parent = [e.name], e.cpu_parent
        while parent is not None and len(chain) < CENSUS_DEPTH and chain[-1].startswith("aten::"):
            chain.append(parent.name)
            parent = parent.cpu_parent
        key = tuple(chain)
        row = rows.setdefault(key, {"launches": 0, "us": 0.0, "categories": collections.Counter()})
        for k in launched:
            row["launches"] += 1
            if k is not None:
                row["us"] += float(getattr(k, "duration", 0.0) or 0.0)
                row["categories"][categorize(k.name, moe)] += 1
    table = sorted(rows.items(), key=lambda kv: -kv[1]["launches"])[:top]
    return [
        {"ops": " < ".join(k)[:240], "launches_per_step": round(r["launches"] / steps, 1),
         "ms_per_step": round(r["us"] / steps / 1000, 3),
         "category": r["categories"].most_common(1)[0][0] if r["categories"] else "cpu op"}
        for k, r in table
    ]


def _active(cpu, starts, t: float, scan: int = 4000) -> tuple[str, str | None]:
    """Innermost CPU op (latest start) running at time `t`, and the innermost CUDA runtime call."""
    i = bisect.bisect_right(starts, t) - 1
    op = runtime = None
    # Scanning back from t: a runtime call nests inside its op and so starts later; once the
    # innermost op is found, any active runtime call has been seen.
    for j in range(i, max(-1, i - scan), -1):
        s, e, name, kind = cpu[j]
        if e < t:
            continue
        if kind in RUNTIME_KINDS:
            runtime = runtime or name
        elif not name.startswith("ProfilerStep"):
            op = name
            break
    return op or "(no CPU op: idle host or another process)", runtime


def print_report(report: dict, device: torch.device) -> None:
    if report.get("checkpointing"):
        log(f"\ncheckpointing: {report['checkpointing']['summary']}")
    if device.type != "cuda":
        log(f"\nCPU ops per step (no GPU, so no kernel launches): {report['launches_per_step']:,}")
        log("\n(no GPU: top CPU ops by self time)\n" + report.get("cpu_table", ""))
        _print_census(report)
        return
    log(f"\nkernel launches per step: {report['launches_per_step']:,}; GPU kernel time per step: "
        f"{report.get('gpu_kernel_ms_per_step')} ms of {report['wall_ms_per_step']} ms wall; GPU busy in the "
        f"kernel window: {report.get('gpu_busy_fraction')}")
    log(f"\ntop {len(report['top_kernels'])} kernels by GPU time:")
    log(f"{'total ms':>10} {'share':>6} {'calls':>7} {'avg us':>9}  kernel")
    for k in report["top_kernels"]:
        log(f"{k['total_ms']:>10.2f} {k['share']:>6.1%} {k['calls']:>7} {k['avg_us']:>9.1f}  {k['name'][:110]}")
    log("\nGPU kernel time by category (kernel-name rules, fastqwen_bench/profile.py CATEGORY_RULES):")
    log(f"{'ms/step':>9} {'share':>6} {'launches':>9}  category  [top kernels]")
    for name, c in report.get("categories", {}).items():
        log(f"{c['ms_per_step']:>9.2f} {c['share']:>6.1%} {c['launches_per_step']:>9.0f}  {name:<17} "
            f"[{'; '.join(k[:40] for k in c['kernels'][:3])}]")
    log(f"\nGPU idle gaps > {report['gap_threshold_us']:g} us: {report['idle_gaps_ms_per_step']} ms per step, "
        f"by the CPU op running at the time:")
    log(f"{'ms/step':>9} {'count':>6}  cpu op  [cuda runtime call]")
    for g in report["idle_gaps"]:
        rt = f"  [{g['runtime_call']}]" if g["runtime_call"] else ""
        log(f"{g['ms_per_step']:>9.2f} {g['count']:>6}  {g['cpu_op'][:90]}{rt}")
    _print_census(report)


def _print_census(report: dict) -> None:
    if not report.get("launch_census"):
        return
    unit = "kernels" if report.get("unit") == "cuda_kernels" else "leaf CPU ops (no GPU)"
    log(f"\nlaunch census: {unit} per step by the CPU ops that issued them (launching op < its callers):")
    log(f"{'launches':>9} {'ms/step':>9}  {'category':<17} ops")
    for r in report["launch_census"]:
        log(f"{r['launches_per_step']:>9.1f} {r['ms_per_step']:>9.2f}  {r['category']:<17} {r['ops'][:150]}")


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    fit = args.path in CHECKPOINTING_AUTO and args.gc
    setup = prepare(args, steps_per_path=args.warmup + args.steps + (FIT_STEPS if fit else 0))
    spec = PATHS[args.path]
    os.makedirs(args.out, exist_ok=True)
    setup.reset()
    optimizer = setup.optimizer()
    try:
        prof, wall, mbs, checkpointing = _profile_path(args, setup, spec, optimizer)
    except PathSkipped as exc:
        log(f"[{args.path}] skipped: {exc}")
        return 1
    log(f"[{args.path}] profiled {args.steps} steps in {wall:.2f} s; analysing ...")
    return _report(args, setup, spec, prof, wall, mbs, checkpointing)


def _profile_path(args, setup, spec, optimizer):
    """Warm-up (a fastqwen_checkpointing: auto path first runs its fitting steps), then N steps
    under torch.profiler; the fitter keeps watching the profiled steps as it does in training."""
    from torch.profiler import ProfilerActivity, profile, record_function

    device, model = setup.device, setup.model
    fit = args.path in CHECKPOINTING_AUTO and args.gc
    warmup = args.warmup + (FIT_STEPS if fit else 0)
    with installed(args.path, model, setup.family, device, setup.dtype, bool(args.gc)) as info, \
            contextlib.ExitStack() as undo:
        for note in info["notes"]:
            log(f"[{args.path}] note: {note}")
        fitter = None
        if fit:
            fitter = CheckpointFitter(model, memory_of(device), fraction=args.checkpointing_memory)
            undo.callback(fitter.restore)

        def step(batch):
            if fitter is not None:
                fitter.step_begin()
            loss = train_step(model, optimizer, data.to_device(batch, device), setup.amp)
            if fitter is not None:
                fitter.step_end()
            return loss

        mbs = setup.micro_batch_size if spec.layout == "padded" else 1
        steps = setup.workload.steps(spec.layout, warmup + args.steps, mbs)
        batches = [data.collate(spec.layout, [setup.workload.tokens(i) for i in ids], args.budget) for ids in steps]
        for i in range(warmup):
            t = time.perf_counter()
            loss = float(step(batches[i]))
            log(f"[{args.path}] warm-up {i + 1}/{warmup}: {time.perf_counter() - t:.2f} s, loss {loss:.4f}"
                + (f"; checkpointing: {fitter.summary()}" if fitter is not None else ""))
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        measure.sync(device)
        t = time.perf_counter()
        with profile(activities=activities) as prof:
            for j in range(args.steps):
                with record_function(f"fastqwen_bench_step_{j}"):
                    step(batches[warmup + j])
                measure.sync(device)
        wall = time.perf_counter() - t
        checkpointing = fitter.to_dict() if fitter is not None else None
    return prof, wall, mbs, checkpointing


def _report(args, setup, spec, prof, wall: float, mbs: int, checkpointing: dict | None) -> int:
    device = setup.device
    events = measure.kineto_events(prof)
    moe = bool(getattr(setup.config, "num_experts", 0))
    report = analyze(events, args.steps, args.gap_us, args.top, moe=moe)
    try:
        report["launch_census"] = launch_census(prof.events(), args.steps, args.census_rows, moe=moe)
    except Exception as exc:  # a diagnostic: never lose the rest of a profile (GPU time) to it
        report["launch_census"] = []
        log(f"[{args.path}] launch census failed: {type(exc).__name__}: {exc}")
    report.update(path=args.path, steps=args.steps, wall_ms_per_step=round(wall / args.steps * 1000, 1),
                  unit="cuda_kernels" if device.type == "cuda" else "cpu_ops", model=setup.info,
                  micro_batch_size=mbs if spec.layout == "padded" else None,
                  checkpointing=checkpointing, versions=environment(device))
    if device.type != "cuda":
        report["gpu_kernel_ms_per_step"] = None
        cpu_ops = [e for e in events if "CPU" in str(measure._field(e, "device_type", ""))]
        report["launches_per_step"] = round(len(cpu_ops) / args.steps, 1)
        report["cpu_table"] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top)
    trace = os.path.join(args.out, "trace.json")
    if args.trace:
        prof.export_chrome_trace(trace)
        if os.path.getsize(trace) > GZIP_ABOVE_BYTES:
            with open(trace, "rb") as src, gzip.open(trace + ".gz", "wb") as dst:
                shutil.copyfileobj(src, dst)
            os.remove(trace)
            trace += ".gz"
    report["trace"] = os.path.basename(trace) if args.trace else None
    with open(os.path.join(args.out, "profile.json"), "w") as f:
        json.dump(report, f, indent=2, default=str)
    print_report(report, device)
    if args.trace:
        log(f"\nwrote {trace} and {os.path.join(args.out, 'profile.json')} (open the trace in Perfetto)")
    else:
        log(f"\nwrote {os.path.join(args.out, 'profile.json')} (no trace: --no-trace)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
