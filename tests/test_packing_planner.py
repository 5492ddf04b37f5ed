"""Bin planning: coverage, budget, rank balance, determinism, efficiency, overlong handling."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from axolotl_fastqwen.packing import Piece, packing_stats, plan_bins
from axolotl_fastqwen.packing.planner import best_fit_decreasing, plan_epoch
from axolotl_fastqwen.packing.stats import skewed_lengths

FAST = settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
MANY = settings(max_examples=800, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def length_lists(draw, budget: int, overlong: bool = False) -> list[int]:
    """Adversarial shapes: random, all equal, all near the budget, one huge, mostly empty, tiny; with
    `overlong`, also the lengths at each side of a multiple of the budget (where an off-by-one lives)."""
    top = 3 * budget if overlong else budget
    kinds = ["random", "equal", "near_budget", "single_huge", "mostly_empty", "tiny"] + (["edges"] if overlong else [])
    kind = draw(st.sampled_from(kinds))
    if kind == "edges":
        edges = [k * budget + d for k in (1, 2) for d in (-1, 0, 1)]
        return draw(st.lists(st.sampled_from(edges), min_size=1, max_size=30))
    if kind == "random":
        return draw(st.lists(st.integers(0, top), max_size=200))
    if kind == "equal":
        return [draw(st.integers(0, top))] * draw(st.integers(0, 100))
    if kind == "near_budget":
        return draw(st.lists(st.integers(budget - 3, budget), max_size=60))
    if kind == "single_huge":
        rest = draw(st.lists(st.integers(1, max(1, budget // 8)), max_size=60))
        rest.insert(draw(st.integers(0, len(rest))), top)
        return rest
    if kind == "mostly_empty":
        return draw(st.lists(st.sampled_from([0, 0, 0, 1, budget]), max_size=40))
    return draw(st.lists(st.integers(0, 3), max_size=8))


def item_range(item, lengths) -> tuple[int, int, int]:
    if isinstance(item, Piece):
        return item.index, item.start, item.stop
    return item, 0, int(lengths[item])


def all_ranks(lengths, budget, n, **kw) -> list[list[list]]:
    return [plan_bins(lengths, budget, num_replicas=n, rank=r, **kw) for r in range(n)]


def check_plan(lengths, budget, n, overlong="error", seed=0, epoch=0) -> list[list[list]]:
    ranks = all_ranks(lengths, budget, n, seed=seed, epoch=epoch, overlong=overlong)
    # equal bin count per rank
    assert len({len(r) for r in ranks}) == 1, [len(r) for r in ranks]
    covered: dict[int, list[tuple[int, int]]] = {}
    fillers = 0
    bins = [b for r in ranks for b in r]
    for b in bins:
        assert b, "empty bin"
        tokens = 0
        for item in b:
            index, start, stop = item_range(item, lengths)
            assert 0 <= start < stop <= lengths[index]
            tokens += stop - start
            if isinstance(item, Piece) and item.filler:
                assert len(b) == 1, "a filler shares its bin"
                fillers += 1
            else:
                covered.setdefault(index, []).append((start, stop))
        assert tokens <= budget, (b, tokens)
    whole = {item for b in bins for item in b if not isinstance(item, Piece)}
    # every non-empty sample exactly once (its pieces tile [0, L) or [0, budget) when truncated)
    expected = {i for i, length in enumerate(lengths) if length > 0}
    assert set(covered) == expected
    for index, spans in covered.items():
        spans.sort()
        length = int(lengths[index])
        want_stop = min(length, budget) if overlong == "truncate" else length
        assert spans[0][0] == 0 and spans[-1][1] == want_stop, (index, spans)
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:])), (index, spans)
        if overlong != "split":
            assert len(spans) == 1
        if length <= budget:
            assert spans == [(0, length)] and index in whole, "a sample that fits became a piece"
    # minimal rounding up: single-rank plan rounded up to a multiple of n; fillers only if unavoidable
    base = len(plan_bins(lengths, budget, seed=seed, epoch=epoch, overlong=overlong))
    assert len(bins) == math.ceil(base / n) * n
    if fillers:
        assert fillers < n
        assert all(len(b) == 1 for b in bins)
    return ranks


@MANY
@given(data=st.data(), budget=st.sampled_from([64, 128, 256, 1024]), n=st.integers(1, 8))
def test_every_sample_once_within_budget_equal_per_rank(data, budget, n):
    lengths = data.draw(length_lists(budget))
    check_plan(lengths, budget, n, seed=data.draw(st.integers(0, 3)), epoch=data.draw(st.integers(0, 3)))


@FAST
@given(data=st.data(), budget=st.sampled_from([64, 128]), n=st.integers(1, 8), mode=st.sampled_from(["truncate", "split"]))
def test_overlong_modes_cover_samples(data, budget, n, mode):
    lengths = data.draw(length_lists(budget, overlong=True))
    check_plan(lengths, budget, n, overlong=mode)


@FAST
@given(data=st.data(), budget=st.sampled_from([64, 256]), n=st.integers(1, 8))
def test_deterministic_per_seed_and_epoch(data, budget, n):
    lengths = data.draw(length_lists(budget))
    seed, epoch = data.draw(st.integers(0, 100)), data.draw(st.integers(0, 100))
    first = all_ranks(lengths, budget, n, seed=seed, epoch=epoch)
    assert all_ranks(list(lengths), budget, n, seed=seed, epoch=epoch) == first
    # the bin count (hence the sampler's len) does not depend on the epoch
    assert sum(map(len, all_ranks(lengths, budget, n, seed=seed, epoch=epoch + 1))) == sum(map(len, first))


def test_epochs_and_seeds_reorder_bins():
    lengths = skewed_lengths(3000, 4096, seed=1)
    plans = {(s, e): plan_bins(lengths, 4096, seed=s, epoch=e) for s in (0, 1) for e in range(4)}
    orders = [tuple(map(tuple, p)) for p in plans.values()]
    assert len(set(orders)) == len(orders), "some (seed, epoch) pairs gave the same order"
    first_items = {tuple(sorted(b[0] for b in p)) for p in plans.values()}
    assert len(first_items) > 1, "bin contents never change across epochs"


@FAST
@given(lengths=st.lists(st.integers(1, 256), max_size=120))
def test_best_fit_matches_naive_best_fit(lengths):
    budget = 256
    ordered = np.array(sorted(lengths, reverse=True), dtype=np.int64)
    bin_of, count = best_fit_decreasing(ordered, budget)
    rooms: list[int] = []
    for length in ordered.tolist():  # textbook BFD: the fitting bin with the least room
        fits = [i for i, r in enumerate(rooms) if r >= length]
        if fits:
            best = min(fits, key=rooms.__getitem__)
            rooms[best] -= length
        else:
            rooms.append(budget - length)
    assert count == len(rooms)
    loads = np.bincount(bin_of, weights=ordered, minlength=count) if count else np.zeros(0)
    assert sorted((budget - loads).astype(int).tolist()) == sorted(rooms)


@pytest.mark.parametrize("budget", [4096, 8192, 16384])
def test_skewed_distribution_within_two_percent_of_lower_bound(budget):
    lengths = skewed_lengths(50_000, budget)
    bins = plan_bins(lengths, budget)
    lower = math.ceil(lengths.sum() / budget)
    assert len(bins) <= 1.02 * lower, (len(bins), lower)
    stats = packing_stats(lengths, budget, 8)
    assert stats.bins == len(bins) and stats.lower_bound == lower
    assert stats.padded_batches == math.ceil(50_000 / 8)


def test_overlong_error_names_the_numbers_and_the_fix():
    with pytest.raises(ValueError) as err:
        plan_bins([10, 9000, 70, 12000], 8192)
    msg = str(err.value)
    for part in ("12000", "2 samples are longer", "8192", "fastqwen_token_budget", "fastqwen_overlong: truncate|split",
                 "the longest: dataset index 3 (12000 tokens), dataset index 1 (9000 tokens)"):
        assert part in msg, (part, msg)
    with pytest.raises(ValueError, match=r"^1 sample is longer than the token budget of 64 tokens: dataset index 1 "
                                         r"\(65 tokens\)\. "):
        plan_bins([10, 65], 64)


@pytest.mark.parametrize("bad", [0, -64, 100, 8100, 64.0, True, "8192"])
def test_budget_must_be_positive_multiple_of_64(bad):
    with pytest.raises(ValueError) as err:
        plan_bins([1, 2], bad)
    msg = str(err.value)
    assert repr(bad) in msg and "multiple of 64" in msg and "fastqwen_token_budget" in msg


@pytest.mark.parametrize("budget", [64, 128])
@pytest.mark.parametrize("mode", ["truncate", "split"])
def test_the_overlong_boundary_budget_is_whole_budget_plus_one_is_cut(mode, budget):
    """Exactly `budget` tokens fits (a whole sample, its plain index); `budget + 1` is overlong:
    truncate keeps its first `budget` tokens, split makes `budget` and 1. No row holds more than the
    budget. (Pinned: a cut at `> budget + 1` passed the property test, which seldom drew budget + 1.)"""
    plan = plan_epoch([budget, budget + 1, budget - 1], budget, overlong=mode)
    items = [item for b in plan.bins for item in b]
    assert 0 in items and 2 in items  # budget and budget - 1: whole
    pieces = sorted((p.index, p.start, p.stop) for p in items if isinstance(p, Piece))
    assert pieces == ([(1, 0, budget)] if mode == "truncate" else [(1, 0, budget), (1, budget, budget + 1)])
    assert plan.overlong == 1 and int(plan.bin_tokens.max()) <= budget
    assert plan.real_tokens == (3 * budget - 1 if mode == "truncate" else 3 * budget)
    with pytest.raises(ValueError, match=f"1 sample is longer than the token budget of {budget} tokens"):
        plan_epoch([budget, budget + 1], budget, overlong="error")
    assert plan_epoch([budget], budget).overlong == 0


def test_truncate_and_split_pieces():
    assert plan_bins([200], 64, overlong="truncate") == [[Piece(0, 0, 64)]]
    split = sorted((p.start, p.stop) for b in plan_bins([200], 64, overlong="split") for p in b)
    assert split == [(0, 64), (64, 128), (128, 192), (192, 200)]


def test_empty_and_zero_length_samples_are_skipped():
    assert plan_bins([], 64) == []
    assert plan_bins([0, 0], 64, num_replicas=4, rank=3) == []
    assert plan_bins([0, 5, 0], 64) == [[1]]
    stats = packing_stats([0, 5, 0, 7], 64, 2)
    assert stats.skipped_empty == 2 and stats.samples == 2 and stats.real_tokens == 12


def test_fillers_only_when_splitting_cannot_balance():
    # 3 single-sample bins on 4 ranks: nothing to split, one masked filler bin
    ranks = all_ranks([60, 61, 62], 64, 4)
    fillers = [b for r in ranks for b in r if isinstance(b[0], Piece) and b[0].filler]
    assert len(fillers) == 1 and fillers[0][0].stop - fillers[0][0].start == 60
    # one multi-sample bin on 4 ranks: split into 4, no filler
    ranks = all_ranks([10, 10, 10, 10, 10], 64, 4)
    assert sorted(len(b) for r in ranks for b in r) == [1, 1, 1, 2]


def test_million_lengths_plan_quickly():
    """Not a benchmark: guards against an accidental O(n^2) (1e6 samples take ~1 s)."""
    import time

    lengths = skewed_lengths(1_000_000, 8192)
    start = time.perf_counter()
    plan = plan_epoch(lengths, 8192, num_replicas=8)
    assert time.perf_counter() - start < 20
    assert len(plan) % 8 == 0
