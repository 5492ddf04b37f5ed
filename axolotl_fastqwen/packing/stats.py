"""The packing numbers worth one log line: how close to optimal, and how many steps it saves."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .planner import plan_epoch

SKEWED_MEDIAN = 500
SKEWED_SIGMA = 1.0


def skewed_lengths(n: int, token_budget: int, seed: int = 0) -> np.ndarray:
    """The distribution the packer is measured on: lognormal, median 500 tokens, sigma 1.0 (mean
    ~825, p99 ~5,100), rounded, clipped to [1, token_budget]. Chat / instruction SFT data looks
    like this: mostly short, a long tail that hits the budget."""
    rng = np.random.default_rng(seed)
    raw = rng.lognormal(mean=math.log(SKEWED_MEDIAN), sigma=SKEWED_SIGMA, size=n)
    return np.clip(np.rint(raw), 1, token_budget).astype(np.int64)


@dataclass(frozen=True)
class PackingStats:
    """One epoch's packing, across all ranks, against the two alternatives.

    `lower_bound` = ceil(real_tokens / token_budget): no packing needs fewer rows. `padded_batches`
    = ceil(samples / micro_batch_size): the batches plain padded batching would run.
    """

    token_budget: int
    micro_batch_size: int
    num_replicas: int
    samples: int  # non-empty samples
    skipped_empty: int  # zero-length samples left out
    overlong: int  # samples longer than the budget (truncated or split)
    real_tokens: int  # tokens trained on (after truncation; fillers excluded)
    bins: int  # rows per epoch across all ranks, split and filler bins included
    split_bins: int  # bins added by splitting to divide evenly across ranks
    filler_bins: int  # loss-masked bins added to divide evenly across ranks
    lower_bound: int
    padded_batches: int

    @property
    def bins_per_rank(self) -> int:
        return self.bins // self.num_replicas

    @property
    def padding_fraction(self) -> float:
        """Share of the packed rows' token slots that train nothing (tail padding and fillers)."""
        slots = self.bins * self.token_budget
        return 1.0 - self.real_tokens / slots if slots else 0.0

    @property
    def over_lower_bound_pct(self) -> float:
        return 100.0 * (self.bins / self.lower_bound - 1.0) if self.lower_bound else 0.0

    @property
    def reduction_pct(self) -> float:
        """How many fewer forward passes than padded batches of `micro_batch_size`, in %."""
        return 100.0 * (1.0 - self.bins / self.padded_batches) if self.padded_batches else 0.0

    def format(self) -> str:
        return (
            f"fastqwen packing: {self.samples:,} samples ({self.skipped_empty:,} empty skipped, "
            f"{self.overlong:,} overlong), {self.real_tokens:,} tokens -> {self.bins:,} rows of "
            f"{self.token_budget} ({self.bins_per_rank:,} per rank x {self.num_replicas}; lower bound "
            f"{self.lower_bound:,}, +{self.over_lower_bound_pct:.2f}%; {self.split_bins} split, "
            f"{self.filler_bins} filler), padding {100 * self.padding_fraction:.1f}%; vs "
            f"{self.padded_batches:,} padded batches of {self.micro_batch_size}: "
            f"{self.reduction_pct:.1f}% fewer steps, 1 shape"
        )


def packing_stats(
    lengths,
    token_budget: int,
    micro_batch_size: int,
    *,
    seed: int = 0,
    epoch: int = 0,
    num_replicas: int = 1,
    overlong: str = "error",
) -> PackingStats:
    """Plan one epoch the way `PackedBatchSampler` does and report it."""
    if isinstance(micro_batch_size, bool) or not isinstance(micro_batch_size, int) or micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be a positive int, got {micro_batch_size!r}")
    plan = plan_epoch(lengths, token_budget, seed=seed, epoch=epoch, num_replicas=num_replicas, overlong=overlong)
    return PackingStats(
        token_budget=plan.token_budget,
        micro_batch_size=micro_batch_size,
        num_replicas=num_replicas,
        samples=plan.samples,
        skipped_empty=plan.skipped_empty,
        overlong=plan.overlong,
        real_tokens=plan.real_tokens,
        bins=len(plan),
        split_bins=plan.split_bins,
        filler_bins=plan.filler_bins,
        lower_bound=math.ceil(plan.real_tokens / plan.token_budget),
        padded_batches=math.ceil(plan.samples / micro_batch_size),
    )
