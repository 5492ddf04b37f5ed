"""PackedBatchSampler under accelerate: rank assignment, exact length, epoch forwarding."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from accelerate.data_loader import BatchSamplerShard, DataLoaderShard, prepare_data_loader
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from axolotl_fastqwen.packing import PackedBatchSampler, PackedCollator, Piece, PieceDataset, plan_bins

SETTINGS = settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
BUDGET = 128

lengths_strategy = st.one_of(
    st.lists(st.integers(0, BUDGET), max_size=150),
    st.lists(st.integers(BUDGET - 2, BUDGET), max_size=20),
    st.lists(st.sampled_from([0, 1, 5]), max_size=10),
    st.integers(1, BUDGET).flatmap(lambda n: st.lists(st.just(n), max_size=40)),
)


@SETTINGS
@given(lengths=lengths_strategy, n=st.integers(1, 8), even=st.booleans(), seed=st.integers(0, 5), epoch=st.integers(0, 5))
def test_batch_sampler_shard_deals_each_rank_its_plan(lengths, n, even, seed, epoch):
    sampler = PackedBatchSampler(lengths, BUDGET, seed=seed, num_replicas=n)
    sampler.set_epoch(epoch)
    yielded = list(sampler)
    assert len(sampler) == len(yielded) and len(yielded) % n == 0
    for rank in range(n):
        shard = BatchSamplerShard(sampler, num_processes=n, process_index=rank, split_batches=False, even_batches=even)
        got = list(shard)
        assert got == plan_bins(lengths, BUDGET, seed=seed, epoch=epoch, num_replicas=n, rank=rank)
        assert len(shard) == len(got) == len(yielded) // n


@SETTINGS
@given(lengths=lengths_strategy, n=st.integers(1, 8))
def test_uninterleaved_sampler_yields_one_rank(lengths, n):
    for rank in range(n):
        sampler = PackedBatchSampler(lengths, BUDGET, num_replicas=n, rank=rank, interleave_replicas=False)
        got = list(sampler)
        assert got == plan_bins(lengths, BUDGET, num_replicas=n, rank=rank) and len(sampler) == len(got)


def test_set_epoch_replans_with_the_same_length():
    lengths = np.random.default_rng(0).integers(1, BUDGET, 500)
    sampler = PackedBatchSampler(lengths, BUDGET, seed=3, num_replicas=4)
    first, size = list(sampler), len(sampler)
    sampler.set_epoch(1)
    assert list(sampler) != first and len(sampler) == size
    assert list(sampler) == [b for r in zip(*(plan_bins(lengths, BUDGET, seed=3, epoch=1, num_replicas=4, rank=k) for k in range(4))) for b in r]
    sampler.set_epoch(0)
    assert list(sampler) == first


def test_overlong_error_at_construction():
    with pytest.raises(ValueError, match="fastqwen_overlong"):
        PackedBatchSampler([10, 500], BUDGET)
    assert PackedBatchSampler([10, 500], BUDGET, overlong="split").needs_piece_dataset
    assert not PackedBatchSampler([10, 50, 60], BUDGET).needs_piece_dataset


def make_rows(lengths) -> list[dict]:
    # sample i holds tokens (i + 1) * 1000 + 0..n-1, so every token names its sample; pad id is 0
    return [{"input_ids": [(i + 1) * 1000 + t for t in range(n)]} for i, n in enumerate(lengths)]


def segments(batch: dict) -> list[tuple[int, int]]:
    """(sample index, length) of every non-padding segment of a collated row."""
    cu, ids = batch["fastqwen_cu_seqlens_host"], batch["input_ids"][0]
    return [(int(ids[a]) // 1000 - 1, b - a) for a, b in zip(cu, cu[1:]) if int(ids[a]) != 0]


def bin_of_batch(batch: dict) -> list[int]:
    return [index for index, _ in segments(batch)]


@pytest.mark.parametrize("n", [2, 3])
def test_accelerate_dataloader_forwards_epochs_to_the_plan(n):
    """The real accelerate path: prepare_data_loader -> DataLoaderShard(BatchSamplerShard(ours))."""
    lengths = np.random.default_rng(1).integers(2, 60, 300).tolist()
    rows = make_rows(lengths)
    for rank in range(n):
        sampler = PackedBatchSampler(lengths, BUDGET, seed=7, num_replicas=n)
        loader = DataLoader(rows, batch_sampler=sampler, collate_fn=PackedCollator(BUDGET))
        prepared = prepare_data_loader(loader, num_processes=n, process_index=rank, put_on_device=False)
        assert isinstance(prepared, DataLoaderShard) and isinstance(prepared.batch_sampler, BatchSamplerShard)
        assert len(prepared) == len(sampler) // n
        for epoch in (0, 1):  # DataLoaderShard calls set_epoch(self.iteration) on each pass
            want = plan_bins(lengths, BUDGET, seed=7, epoch=epoch, num_replicas=n, rank=rank)
            got = [bin_of_batch(batch) for batch in prepared]
            assert got == want
            assert sampler.epoch == epoch
        prepared.set_epoch(5)  # what the Trainer calls
        assert sampler.epoch == 5
        assert [bin_of_batch(batch) for batch in prepared] == plan_bins(lengths, BUDGET, seed=7, epoch=5, num_replicas=n, rank=rank)


def test_dataloader_with_pieces_and_workers():
    lengths = [300, 5, 0, 40, 128]
    rows = make_rows(lengths)
    sampler = PackedBatchSampler(lengths, BUDGET, overlong="split")
    loader = DataLoader(PieceDataset(rows), batch_sampler=sampler, collate_fn=PackedCollator(BUDGET), num_workers=1)
    seen: dict[int, int] = {}
    for batch in loader:
        for index, length in segments(batch):
            seen[index] = seen.get(index, 0) + length
    assert seen == {0: 300, 1: 5, 3: 40, 4: 128}
    assert any(isinstance(item, Piece) for b in sampler for item in b)


def test_sampler_is_a_batch_sampler_with_dynamic_batch_size():
    sampler = PackedBatchSampler([3, 4], BUDGET)
    assert isinstance(sampler, torch.utils.data.BatchSampler)
    assert sampler.batch_size is None and not sampler.drop_last
    assert not hasattr(sampler.sampler, "generator")
    assert sorted(sampler.sampler) == [0, 1] and len(sampler.sampler) == 2
