"""Benchmark the packer: planning speed, sampler+collator throughput on one core, rows vs the lower
bound, and batch counts vs plain padded batches and Axolotl's own multipack.

    python tools/bench_packer.py                 # all sections
    python tools/bench_packer.py --runs 7 --json out.json

Lengths follow `packing.stats.skewed_lengths` (lognormal, median 500, sigma 1, clipped at the
budget). CPU timings are noisy: every timing is the median of `--runs` runs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time

import numpy as np
import torch

from axolotl_fastqwen.packing import PackedBatchSampler, PackedCollator
from axolotl_fastqwen.packing.planner import plan_epoch
from axolotl_fastqwen.packing.stats import packing_stats, skewed_lengths


def median_time(fn, runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_plan(n: int, budget: int, replicas: int, runs: int) -> dict:
    lengths = skewed_lengths(n, budget)
    seconds = median_time(lambda: plan_epoch(lengths, budget, num_replicas=replicas), runs)
    return {"samples": n, "token_budget": budget, "num_replicas": replicas, "plan_seconds": seconds}


def bench_throughput(n: int, budget: int, runs: int, as_tensors: bool) -> dict:
    """Sampler (plan + iterate) + row fetch + collate, like a DataLoader with num_workers=0."""
    lengths = skewed_lengths(n, budget, seed=1)
    rng = np.random.default_rng(1)
    rows = []
    for length in lengths.tolist():
        ids = rng.integers(0, 150_000, length)
        rows.append({"input_ids": torch.from_numpy(ids) if as_tensors else ids.tolist()})
    collator = PackedCollator(budget)
    tokens = int(lengths.sum())
    epoch = iter(range(10**6))

    def one_epoch():
        sampler = PackedBatchSampler(lengths, budget, seed=next(epoch))
        for bin_ in sampler:
            collator([rows[i] for i in bin_])

    seconds = median_time(one_epoch, runs)
    return {
        "samples": n,
        "token_budget": budget,
        "rows": "1-D tensors" if as_tensors else "lists of ints",
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
    }


def padded_shapes(lengths: np.ndarray, micro_batch_size: int, multiple: int, seed: int = 0) -> int:
    """Distinct padded lengths that shuffled padded batches produce in one epoch (one per new shape)."""
    order = np.random.default_rng(seed).permutation(lengths.size)
    batches = lengths[order][: lengths.size // micro_batch_size * micro_batch_size].reshape(-1, micro_batch_size)
    longest = batches.max(axis=1)
    if lengths.size % micro_batch_size:
        longest = np.append(longest, lengths[order][-(lengths.size % micro_batch_size) :].max())
    return int(np.unique(-(-longest // multiple) * multiple).size)


def padded_token_slots(lengths: np.ndarray, micro_batch_size: int, multiple: int, seed: int = 0) -> int:
    """Token slots (batch x padded length, summed) that shuffled padded batches compute in one epoch."""
    order = np.random.default_rng(seed).permutation(lengths.size)
    shuffled = lengths[order]
    starts = np.arange(0, lengths.size, micro_batch_size)
    longest = np.maximum.reduceat(shuffled, starts)
    sizes = np.diff(np.append(starts, lengths.size))
    return int((sizes * (-(-longest // multiple) * multiple)).sum())


def axolotl_multipack_batches(lengths: np.ndarray, budget: int) -> int | None:
    """Batches Axolotl 0.21's MultipackBatchSampler yields for one epoch (batch_size=1, budget per row,
    its config defaults bin_size=200, group_size=100_000, single process)."""
    try:
        from axolotl.utils.samplers.multipack import MultipackBatchSampler
    except ImportError:
        return None
    base = torch.utils.data.RandomSampler(range(lengths.size), generator=torch.Generator().manual_seed(0))
    sampler = MultipackBatchSampler(
        base,
        batch_size=1,
        batch_max_len=budget,
        lengths=lengths,
        bin_size=200,
        group_size=100_000,
        num_processes=1,
        drop_last=True,
    )
    return sum(1 for _ in sampler)


def bench_bins(n: int, budgets: list[int], micro_batch_sizes: list[int]) -> list[dict]:
    rows = []
    for budget in budgets:
        lengths = skewed_lengths(n, budget)
        stats = packing_stats(lengths, budget, micro_batch_sizes[0])
        multipack = axolotl_multipack_batches(lengths, budget)
        row = {
            "token_budget": budget,
            "samples": stats.samples,
            "tokens": stats.real_tokens,
            "bins": stats.bins,
            "lower_bound": stats.lower_bound,
            "over_lower_bound_pct": stats.over_lower_bound_pct,
            "padding_pct": 100 * stats.padding_fraction,
            "axolotl_multipack_batches": multipack,
            "vs_multipack_pct": None if multipack is None else 100 * (1 - stats.bins / multipack),
            "log_line": stats.format(),
        }
        for mbs in micro_batch_sizes:
            padded = math.ceil(stats.samples / mbs)
            row[f"padded_batches_mbs{mbs}"] = padded
            row[f"vs_padded_mbs{mbs}_pct"] = 100 * (1 - stats.bins / padded)
            row[f"padded_shapes_mbs{mbs}_mult64"] = padded_shapes(lengths, mbs, 64)
            row[f"padded_shapes_mbs{mbs}_mult1"] = padded_shapes(lengths, mbs, 1)
            row[f"padded_slots_over_packed_mbs{mbs}"] = padded_token_slots(lengths, mbs, 64) / (stats.bins * budget)
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5, help="timing runs; the median is reported")
    parser.add_argument("--plan-samples", type=int, default=1_000_000)
    parser.add_argument("--throughput-samples", type=int, default=10_000)
    parser.add_argument("--bins-samples", type=int, default=200_000)
    parser.add_argument("--budgets", type=int, nargs="+", default=[4096, 8192, 16384])
    parser.add_argument("--micro-batch-sizes", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)

    torch.set_num_threads(1)  # one core, as a DataLoader worker has
    results = {"cpu": os.cpu_count(), "torch_threads": torch.get_num_threads(), "runs": args.runs}

    results["plan"] = [bench_plan(args.plan_samples, b, 8, args.runs) for b in (8192,)]
    for r in results["plan"]:
        print(f"plan {r['samples']:,} lengths, budget {r['token_budget']}, {r['num_replicas']} ranks: "
              f"{r['plan_seconds']:.2f} s (median of {args.runs})")

    results["throughput"] = [
        bench_throughput(args.throughput_samples, 8192, args.runs, as_tensors)
        for as_tensors in (False, True)
    ]
    for r in results["throughput"]:
        print(f"sampler+collator, budget {r['token_budget']}, rows as {r['rows']}: "
              f"{r['tokens_per_s'] / 1e6:.1f} M tokens/s ({r['tokens']:,} tokens in {r['seconds']:.2f} s, "
              f"median of {args.runs}, 1 thread)")

    results["bins"] = bench_bins(args.bins_samples, args.budgets, args.micro_batch_sizes)
    mbs = args.micro_batch_sizes
    header = ["budget", "rows", "lower bound", "over LB", "padding", "Axolotl multipack", "vs multipack"]
    header += [f"padded mbs={m}" for m in mbs] + [f"vs mbs={m}" for m in mbs]
    header += [f"shapes mbs={m} (x64 / x1)" for m in mbs]
    header += [f"padded/packed token slots mbs={m}" for m in mbs]
    print("\n| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for r in results["bins"]:
        cells = [
            str(r["token_budget"]),
            f"{r['bins']:,}",
            f"{r['lower_bound']:,}",
            f"+{r['over_lower_bound_pct']:.3f}%",
            f"{r['padding_pct']:.2f}%",
            "n/a" if r["axolotl_multipack_batches"] is None else f"{r['axolotl_multipack_batches']:,}",
            "n/a" if r["vs_multipack_pct"] is None else f"{-r['vs_multipack_pct']:+.2f}%",
        ]
        cells += [f"{r[f'padded_batches_mbs{m}']:,}" for m in mbs]
        cells += [f"{-r[f'vs_padded_mbs{m}_pct']:+.1f}%" for m in mbs]
        cells += [f"{r[f'padded_shapes_mbs{m}_mult64']} / {r[f'padded_shapes_mbs{m}_mult1']}" for m in mbs]
        cells += [f"{r[f'padded_slots_over_packed_mbs{m}']:.2f}x" for m in mbs]
        print("| " + " | ".join(cells) + " |")
    print()
    for r in results["bins"]:
        print(r["log_line"])

    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    main()
