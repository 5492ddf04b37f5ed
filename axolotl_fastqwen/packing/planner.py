"""Bin planning: which samples share one static-shape `[1, token_budget]` row, on which rank.

Packing is best-fit decreasing (BFD), run a run of equal lengths at a time so that the Python loop
turns once per bin fill, not once per sample: 1e6 samples plan in about a second in pure Python +
numpy (benchmarks/packing.md). The bin *structure* depends only on the multiset of lengths, so the bin
count (and the sampler's `__len__`) is the same every epoch; which of several equal-length samples
goes where, and the order of the bins, are reshuffled per `(seed, epoch)`.

Items of a bin are `int` dataset indices in the common case. Two cases need more than an index,
and use `Piece` instead:

* overlong samples (`overlong="truncate"`: the first `token_budget` tokens; `"split"`: consecutive
  budget-sized slices), and
* filler bins (`Piece(..., filler=True)`), added only when the bin count cannot be made divisible
  by the number of ranks by splitting multi-sample bins.

`PieceDataset` (collator module) resolves a `Piece` into a sliced feature and marks fillers so that
`PackedCollator` masks every label of a filler with -100.
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from dataclasses import dataclass

import numpy as np

OVERLONG_MODES = ("error", "truncate", "split")
TOKEN_BUDGET_MULTIPLE = 64  # one GDN chunk: a budget on this grid never leaves a ragged last chunk


@dataclass(frozen=True, slots=True)
class Piece:
    """Tokens `[start, stop)` of dataset sample `index`.

    `filler=True` marks a filler bin: its tokens run through the model (so every rank does the same
    work) but every label is -100, so it adds nothing to the loss. Not a tuple on purpose: handing
    a `Piece` to a plain dataset fails loudly instead of being read as a list of row indices.
    """

    index: int
    start: int
    stop: int
    filler: bool = False

    @property
    def length(self) -> int:
        return self.stop - self.start


Item = int | Piece


def check_token_budget(token_budget: object) -> int:
    """Budgets are multiples of 64 so that every static row tiles the kernels' 64-token chunks."""
    if (
        isinstance(token_budget, bool)
        or not isinstance(token_budget, (int, np.integer))
        or token_budget <= 0
        or token_budget % TOKEN_BUDGET_MULTIPLE
    ):
        example = TOKEN_BUDGET_MULTIPLE
        if isinstance(token_budget, (int, np.integer)) and not isinstance(token_budget, bool) and token_budget > 0:
            example = -(-int(token_budget) // TOKEN_BUDGET_MULTIPLE) * TOKEN_BUDGET_MULTIPLE
        raise ValueError(
            f"token_budget must be a positive multiple of {TOKEN_BUDGET_MULTIPLE}, got {token_budget!r}; "
            f"set fastqwen_token_budget to a multiple of {TOKEN_BUDGET_MULTIPLE} (e.g. {example})."
        )
    return int(token_budget)


def _check_plan_args(num_replicas: int, rank: int, seed: int, epoch: int, overlong: str) -> None:
    if overlong not in OVERLONG_MODES:
        raise ValueError(f"overlong must be one of {OVERLONG_MODES}, got {overlong!r}")
    if not isinstance(num_replicas, (int, np.integer)) or num_replicas < 1:
        raise ValueError(f"num_replicas must be a positive int, got {num_replicas!r}")
    if not isinstance(rank, (int, np.integer)) or not 0 <= rank < num_replicas:
        raise ValueError(f"rank must be in [0, {num_replicas}), got {rank!r}")
    for name, value in (("seed", seed), ("epoch", epoch)):
        if not isinstance(value, (int, np.integer)) or value < 0:
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")


def as_lengths(lengths) -> np.ndarray:
    """Lengths as a 1-D int64 array (list, numpy array or tensor accepted)."""
    if hasattr(lengths, "detach"):
        lengths = lengths.detach().cpu().numpy()
    arr = np.asarray(lengths)
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"lengths must be a 1-D sequence of ints, got shape {arr.shape} dtype {arr.dtype}")
    arr = arr.astype(np.int64, copy=False)
    if arr.min() < 0:
        raise ValueError(f"lengths must be >= 0, got {int(arr.min())} at index {int(arr.argmin())}")
    return arr


@dataclass
class EpochPlan:
    """All ranks' bins for one epoch, in the order the sampler deals them (rank r: bins r, r+N, ...).

    Bins are kept as one flat item list plus boundaries and sliced on demand: materialising 1e5+
    small lists up front would cost more than planning them.
    """

    flat: list[Item]
    bounds: list[int]  # bin b is flat[bounds[b]:bounds[b + 1]]
    num_replicas: int
    token_budget: int
    bin_tokens: np.ndarray  # tokens in each bin, fillers included
    filler_mask: np.ndarray  # bool per bin
    split_bins: int = 0  # bins added by splitting multi-sample bins for divisibility
    samples: int = 0  # non-empty samples planned
    skipped_empty: int = 0  # zero-length samples: nothing to train on, left out
    real_tokens: int = 0  # tokens that reach the loss side (fillers excluded, truncation applied)
    overlong: int = 0  # samples longer than the budget (truncated or split)

    def __len__(self) -> int:
        return len(self.bounds) - 1

    @property
    def filler_bins(self) -> int:
        return int(self.filler_mask.sum())

    def iter_bins(self, rank: int | None = None):
        """All bins in dealing order, or only those of `rank`."""
        first, step = (0, 1) if rank is None else (rank, self.num_replicas)
        flat, bounds = self.flat, self.bounds
        for b in range(first, len(bounds) - 1, step):
            yield flat[bounds[b] : bounds[b + 1]]

    def for_rank(self, rank: int) -> list[list[Item]]:
        return list(self.iter_bins(rank))

    @property
    def bins(self) -> list[list[Item]]:
        return list(self.iter_bins())


def overlong_message(lengths: np.ndarray, token_budget: int, describe=None) -> str:
    """What is too long, by dataset index and length (up to three, longest first), and the fix.

    `describe(index)` may add where that sample comes from (the Axolotl adapter names the row of
    the dataset before Axolotl shuffled it, and how the sample begins)."""
    over = np.flatnonzero(lengths > token_budget)
    worst = over[np.argsort(-lengths[over], kind="stable")][:3]
    parts = []
    for i in worst.tolist():
        where = f"; {describe(i)}" if describe is not None else ""
        parts.append(f"dataset index {i} ({int(lengths[i])} tokens{where})")
    n = over.size
    head = "1 sample is longer" if n == 1 else f"{n} samples are longer"
    listed = parts[0] if n == 1 else "the longest: " + ", ".join(parts) + (", ..." if n > 3 else "")
    return (
        f"{head} than the token budget of {token_budget} tokens: {listed}. Raise fastqwen_token_budget, or set "
        f"fastqwen_overlong: truncate|split (truncate keeps the first {token_budget} tokens, split trains on "
        "every piece)."
    )


def pieces(lengths: np.ndarray, token_budget: int, overlong: str):
    """Packable items: (sample index, start, stop, is_piece), each at most `token_budget` long.

    The one definition of `fastqwen_overlong`: the planner packs these items, and the Axolotl
    adapter materialises them as dataset rows (integration/trainer_packing.py). Empty samples are left out."""
    nonempty = np.flatnonzero(lengths > 0)
    lens = lengths[nonempty]
    over = lens > token_budget
    if not over.any():
        zeros = np.zeros(nonempty.size, dtype=np.int64)
        return nonempty, zeros, lens, np.zeros(nonempty.size, dtype=bool)
    if overlong == "error":
        raise ValueError(overlong_message(lengths, token_budget))
    if overlong == "truncate":
        stop = np.minimum(lens, token_budget)
        return nonempty, np.zeros_like(lens), stop, over
    # split: sample i becomes ceil(L / budget) consecutive pieces.
    reps = np.where(over, -(-lens // token_budget), 1)
    sample = np.repeat(nonempty, reps)
    first = np.repeat(np.cumsum(reps) - reps, reps)
    start = (np.arange(sample.size) - first) * token_budget
    stop = np.minimum(start + token_budget, np.repeat(lens, reps))
    return sample, start, stop, np.repeat(over, reps)


def _index_dtype(max_value: int):
    """Smallest unsigned dtype for values up to `max_value`: numpy radix-sorts 16-bit keys."""
    return np.uint16 if max_value < 2**16 else np.uint32 if max_value < 2**32 else np.uint64


def _push(buckets: dict[int, list[int]], keys: list[int], rem: int, bins) -> None:
    stack = buckets.get(rem)
    if stack is None:
        buckets[rem] = list(bins)
        insort(keys, rem)
    else:
        stack.extend(bins)


def best_fit_decreasing(sorted_lengths: np.ndarray, token_budget: int) -> tuple[np.ndarray, int]:
    """Bin id of every item of `sorted_lengths` (descending, each in [1, budget]), and the bin count.

    Exact BFD: each item goes to the open bin with the least room that still fits it. Equal-length
    items are placed a run at a time (a best-fit bin that takes one takes as many as fit, since it
    stays the best fit), and open bins are indexed by remaining room in a sorted key list, so the
    Python loop runs once per bin fill, not once per token or per (item, bin) pair.
    """
    n = sorted_lengths.size
    bin_of = np.empty(n, dtype=np.int64)
    if n == 0:
        return bin_of, 0
    # Items over half the budget can never share a bin with each other: one bin each.
    big = int(np.count_nonzero(sorted_lengths * 2 > token_budget))
    bin_of[:big] = np.arange(big)
    buckets: dict[int, list[int]] = {}
    keys: list[int] = []
    if big:
        room = token_budget - sorted_lengths[:big]
        order = np.argsort(room, kind="stable")
        room_sorted = room[order]
        cuts = np.flatnonzero(np.diff(room_sorted)) + 1
        for group in np.split(order, cuts):
            r = int(room[group[0]])
            if r:
                _push(buckets, keys, r, group.tolist())
    next_bin = big
    small = sorted_lengths[big:]
    if small.size:
        starts = np.concatenate(([0], np.flatnonzero(np.diff(small)) + 1))
        counts = np.diff(np.append(starts, small.size))
        seg_bin: list[int] = []
        seg_len: list[int] = []
        for length, count in zip(small[starts].tolist(), counts.tolist()):
            while count:
                j = bisect_left(keys, length)
                if j == len(keys):  # nothing open fits: open as many fresh bins as the run needs
                    per = token_budget // length
                    full, last = divmod(count, per)
                    if full:
                        seg_bin.extend(range(next_bin, next_bin + full))
                        seg_len.extend([per] * full)
                        if token_budget - per * length:
                            _push(buckets, keys, token_budget - per * length, range(next_bin, next_bin + full))
                        next_bin += full
                    if last:
                        seg_bin.append(next_bin)
                        seg_len.append(last)
                        _push(buckets, keys, token_budget - last * length, (next_bin,))
                        next_bin += 1
                    break
                room = keys[j]
                stack = buckets[room]
                b = stack.pop()
                if not stack:
                    del buckets[room]
                    del keys[j]
                take = min(count, room // length)
                seg_bin.append(b)
                seg_len.append(take)
                count -= take
                if room - take * length:
                    _push(buckets, keys, room - take * length, (b,))
        bin_of[big:] = np.repeat(np.asarray(seg_bin, dtype=np.int64), np.asarray(seg_len, dtype=np.int64))
    return bin_of, next_bin


def _make_divisible(bin_of: np.ndarray, num_bins: int, num_replicas: int) -> tuple[np.ndarray, int, int, int]:
    """Split multi-sample bins until the bin count divides by `num_replicas`.

    Returns the new bin ids, bin count, how many bins splitting added, and how many filler bins are
    still missing (when every bin already holds a single item). With static shapes every bin costs
    one forward, so which bin is split does not matter for speed: the fullest by item count is
    halved.
    """
    missing = -num_bins % num_replicas
    if not missing:
        return bin_of, num_bins, 0, 0
    bin_of = bin_of.copy()
    counts = np.bincount(bin_of, minlength=num_bins).tolist()
    added = 0
    while missing:
        b = max(range(len(counts)), key=counts.__getitem__)
        if counts[b] < 2:
            break
        members = np.flatnonzero(bin_of == b)
        moved = members[members.size // 2 :]
        bin_of[moved] = len(counts)
        counts[b] -= moved.size
        counts.append(moved.size)
        added += 1
        missing -= 1
    return bin_of, len(counts), added, missing


def plan_epoch(
    lengths,
    token_budget: int,
    *,
    seed: int = 0,
    epoch: int = 0,
    num_replicas: int = 1,
    overlong: str = "error",
) -> EpochPlan:
    """Plan every rank's bins for one epoch (see `plan_bins`)."""
    token_budget = check_token_budget(token_budget)
    _check_plan_args(num_replicas, 0, seed, epoch, overlong)
    lengths = as_lengths(lengths)
    empty = EpochPlan([], [0], num_replicas, token_budget, np.zeros(0, np.int64), np.zeros(0, bool))
    if lengths.size == 0:
        return empty
    skipped = int(np.count_nonzero(lengths == 0))
    sample, start, stop, is_piece = pieces(lengths, token_budget, overlong)
    if sample.size == 0:
        empty.skipped_empty = skipped
        return empty
    item_len = stop - start
    rng = np.random.default_rng([int(seed), int(epoch)])
    # Descending length; ties (equal lengths) in a per-epoch random order.
    perm = rng.permutation(sample.size)
    room = (token_budget - item_len[perm]).astype(_index_dtype(token_budget))  # narrow: radix sort
    order = perm[np.argsort(room, kind="stable")]
    item_len = item_len[order]
    if is_piece.any():
        sample, start, stop, is_piece = (a[order] for a in (sample, start, stop, is_piece))
    else:  # common case, whole samples only: start is all 0 and stop is the length
        sample, stop = sample[order], item_len
    bin_of, num_bins = best_fit_decreasing(item_len, token_budget)
    bin_of, num_bins, split_bins, fillers = _make_divisible(bin_of, num_bins, num_replicas)
    is_filler = np.zeros(sample.size, dtype=bool)
    if fillers:
        # The shortest item is the cheapest real forward; every label of a filler is masked.
        k = sample.size - 1
        sample, start, stop = (np.append(a, np.full(fillers, a[k])) for a in (sample, start, stop))
        is_piece = np.append(is_piece, np.ones(fillers, dtype=bool))
        is_filler = np.append(is_filler, np.ones(fillers, dtype=bool))
        item_len = stop - start
        bin_of = np.append(bin_of, np.arange(num_bins, num_bins + fillers))
        num_bins += fillers
    # Deal bins in a per-epoch random order; items of a bin keep their placement order.
    slot_of_bin = np.empty(num_bins, dtype=_index_dtype(num_bins))
    slot_of_bin[rng.permutation(num_bins)] = np.arange(num_bins)
    slot = slot_of_bin[bin_of]
    by_slot = np.argsort(slot, kind="stable")
    bounds = np.concatenate(([0], np.cumsum(np.bincount(slot, minlength=num_bins))))
    bin_tokens = np.add.reduceat(item_len[by_slot], bounds[:-1])
    bounds = bounds.tolist()
    flat: list[Item] = sample[by_slot].tolist()
    for pos in np.flatnonzero(is_piece[by_slot]).tolist():
        i = by_slot[pos]
        flat[pos] = Piece(int(sample[i]), int(start[i]), int(stop[i]), bool(is_filler[i]))
    filler_mask = np.zeros(num_bins, dtype=bool)
    filler_mask[slot_of_bin[bin_of[is_filler]]] = True
    return EpochPlan(
        flat=flat,
        bounds=bounds,
        num_replicas=num_replicas,
        token_budget=token_budget,
        bin_tokens=bin_tokens,
        filler_mask=filler_mask,
        split_bins=split_bins,
        samples=int(np.count_nonzero(lengths)),
        skipped_empty=skipped,
        real_tokens=int(item_len[~is_filler].sum()),
        overlong=int(np.count_nonzero(lengths > token_budget)),
    )


def plan_bins(
    lengths,
    token_budget: int,
    *,
    seed: int = 0,
    epoch: int = 0,
    num_replicas: int = 1,
    rank: int = 0,
    overlong: str = "error",
) -> list[list[Item]]:
    """Dataset indices of each bin (at most `token_budget` tokens) that rank `rank` trains on.

    Every non-empty sample is in exactly one bin of exactly one rank per epoch; bins are dealt
    round-robin (rank r gets bins r, r+N, ...), the same way accelerate's `BatchSamplerShard` deals
    `PackedBatchSampler`'s output, and every rank gets the same number of bins. The order is
    shuffled from `(seed, epoch)` and is deterministic for a given pair.

    Equal bin counts without dropping or repeating a sample in the loss: while the bin count is
    not divisible by `num_replicas`, the bin with the most samples is split in two (one more bin
    each time). Only if every bin holds one item are filler bins added: `Piece(index, start,
    stop, filler=True)`, a real sample's tokens for a real forward that `PieceDataset` marks and
    `PackedCollator` masks with -100 on every label.

    Overlong samples (longer than `token_budget`): `"error"` raises; `"truncate"` plans the first
    `token_budget` tokens as `Piece(i, 0, token_budget)`; `"split"` plans consecutive pieces
    `Piece(i, k*budget, min((k+1)*budget, L))`, each packed like a sample (each piece's first label
    is masked and it sees no earlier piece). `PieceDataset` slices pieces for the collator; whole
    samples stay plain `int`s. Zero-length samples have nothing to train on and are skipped
    (counted in `packing_stats`). An empty dataset gives `[]`.
    """
    _check_plan_args(num_replicas, rank, seed, epoch, overlong)
    plan = plan_epoch(lengths, token_budget, seed=seed, epoch=epoch, num_replicas=num_replicas, overlong=overlong)
    return plan.for_rank(rank)


def lower_bound_bins(total_tokens: int, token_budget: int) -> int:
    """No packing can use fewer rows than this."""
    return math.ceil(total_tokens / token_budget)
