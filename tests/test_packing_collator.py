"""PackedCollator: static shapes, mutually consistent boundaries, label masking, round trip, errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from axolotl_fastqwen.boundaries import HOST_CU_SEQLENS_KWARG
from axolotl_fastqwen.packing import FILLER_KEY, PackedCollator, Piece, PieceDataset, plan_bins

SETTINGS = settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
IGNORE = -100
PAD = 7


@st.composite
def bins_of_features(draw, budget: int) -> list[dict]:
    """Features whose lengths sum to at most `budget`, in every accepted input form."""
    room = budget
    features = []
    for _ in range(draw(st.integers(0, 12))):
        n = draw(st.integers(0, room))
        room -= n
        ids = draw(st.lists(st.integers(0, 50_000), min_size=n, max_size=n))
        feature: dict = {"input_ids": ids}
        if draw(st.booleans()):
            feature["labels"] = [IGNORE if draw(st.integers(0, 3)) == 0 else t for t in ids]
        if draw(st.booleans()):
            feature["attention_mask"] = [1] * n
        if draw(st.booleans()):
            feature["position_ids"] = list(range(n))
        if draw(st.booleans()):
            feature = {k: torch.tensor(v, dtype=torch.long) for k, v in feature.items()}
        features.append(feature)
    return features


def as_list(x) -> list[int]:
    return x.tolist() if isinstance(x, torch.Tensor) else list(x)


def segments_from_position_ids(position_ids: np.ndarray) -> list[int]:
    """Segment starts as the rotary embedding sees them: wherever the position restarts at 0."""
    return np.flatnonzero(position_ids == 0).tolist()


@SETTINGS
@given(data=st.data(), budget=st.sampled_from([64, 128, 256]))
def test_boundaries_agree_and_round_trip(data, budget):
    features = data.draw(bins_of_features(budget))
    out = PackedCollator(budget, pad_token_id=PAD)(features)

    # static shapes and dtypes, every call
    for key in ("input_ids", "labels", "position_ids"):
        assert out[key].shape == (1, budget) and out[key].dtype == torch.long, key
    assert out["seq_idx"].shape == (1, budget) and out["seq_idx"].dtype == torch.int32
    assert out["cu_seq_lens_q"].dtype == torch.int32 and out["cu_seq_lens_k"].dtype == torch.int32
    assert "attention_mask" not in out

    cu = out["cu_seq_lens_q"].tolist()
    assert out["cu_seq_lens_k"].tolist() == cu
    assert out[HOST_CU_SEQLENS_KWARG] == tuple(cu) and isinstance(out[HOST_CU_SEQLENS_KWARG], tuple)
    assert cu[0] == 0 and cu[-1] == budget and all(b > a for a, b in zip(cu, cu[1:]))
    lengths = np.diff(cu)
    assert out["max_length_q"] == out["max_length_k"] == int(lengths.max())
    assert isinstance(out["max_length_q"], int)

    # each boundary form derived from the others
    pos = out["position_ids"][0].numpy()
    seq_idx = out["seq_idx"][0].numpy()
    labels = out["labels"][0].numpy()
    ids = out["input_ids"][0].numpy()
    assert segments_from_position_ids(pos) == cu[:-1]
    assert np.array_equal(seq_idx, np.repeat(np.arange(len(lengths)), lengths))
    assert np.array_equal(np.flatnonzero(np.diff(seq_idx)) + 1, np.array(cu[1:-1], dtype=np.int64))
    assert np.array_equal(pos, np.arange(budget) - np.asarray(cu)[seq_idx])
    assert (labels[cu[:-1]] == IGNORE).all(), "a sequence's first token is trained"

    # round trip: cutting the row at cu gives back the non-empty features, then the padding tail
    real = [f for f in features if len(as_list(f["input_ids"]))]
    total = sum(len(as_list(f["input_ids"])) for f in real)
    assert len(lengths) == len(real) + (total < budget)
    for k, feature in enumerate(real):
        a, b = cu[k], cu[k + 1]
        assert ids[a:b].tolist() == as_list(feature["input_ids"])
        want = as_list(feature.get("labels", feature["input_ids"]))
        assert labels[a + 1 : b].tolist() == want[1:], "labels changed inside a sequence"
        assert pos[a:b].tolist() == list(range(b - a))
    if total < budget:
        assert (ids[total:] == PAD).all() and (labels[total:] == IGNORE).all()
        assert pos[total:].tolist() == list(range(budget - total))


def test_first_token_of_every_sequence_is_masked():
    out = PackedCollator(64)([{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}, {"input_ids": [6]}])
    assert out["labels"][0, :6].tolist() == [IGNORE, 2, 3, IGNORE, 5, IGNORE]
    assert out["labels"][0, 6:].eq(IGNORE).all()


def test_user_ignore_labels_are_kept():
    out = PackedCollator(64)([{"input_ids": [1, 2, 3, 4], "labels": [1, IGNORE, IGNORE, 4]}])
    assert out["labels"][0, :4].tolist() == [IGNORE, IGNORE, IGNORE, 4]


def test_full_row_has_no_padding_segment():
    out = PackedCollator(64)([{"input_ids": list(range(40))}, {"input_ids": list(range(24))}])
    assert out["cu_seq_lens_q"].tolist() == [0, 40, 64]
    assert out["seq_idx"][0].max().item() == 1


def test_empty_bin_is_one_padding_segment():
    out = PackedCollator(64, pad_token_id=PAD)([])
    assert out["cu_seq_lens_q"].tolist() == [0, 64]
    assert out["input_ids"].eq(PAD).all() and out["labels"].eq(IGNORE).all()


def test_filler_feature_trains_nothing_but_keeps_tokens():
    out = PackedCollator(64)([{"input_ids": [3, 4, 5], "labels": [3, 4, 5], FILLER_KEY: True}])
    assert out["input_ids"][0, :3].tolist() == [3, 4, 5]
    assert out["labels"].eq(IGNORE).all()


def test_over_budget_names_total_and_budget():
    with pytest.raises(ValueError) as err:
        PackedCollator(64)([{"input_ids": [1] * 40}, {"input_ids": [1] * 30}])
    msg = str(err.value)
    assert "70" in msg and "64" in msg and "PackedBatchSampler" in msg


def test_padding_inside_a_feature_is_rejected():
    with pytest.raises(ValueError) as err:
        PackedCollator(64)([{"input_ids": [1, 2], "attention_mask": [1, 1]}, {"input_ids": [0, 5, 6], "attention_mask": [0, 1, 1]}])
    msg = str(err.value)
    assert "feature 1" in msg and "attention_mask[0] = 0" in msg and "padding=False" in msg


def test_packed_position_ids_are_rejected():
    with pytest.raises(ValueError) as err:
        PackedCollator(64)([{"input_ids": [1, 2, 3, 4], "position_ids": [0, 1, 0, 1]}])
    msg = str(err.value)
    assert "position_ids[2] = 0" in msg and "0..3" in msg and "Drop the position_ids" in msg


def test_misaligned_labels_are_rejected():
    with pytest.raises(ValueError, match="3 labels for 2 input_ids"):
        PackedCollator(64)([{"input_ids": [1, 2], "labels": [1, 2, 3]}])


@pytest.mark.parametrize("bad", [0, 100, 4000])
def test_collator_budget_must_be_multiple_of_64(bad):
    with pytest.raises(ValueError) as err:
        PackedCollator(bad)
    assert str(bad) in str(err.value) and "multiple of 64" in str(err.value)


def test_pieces_and_fillers_through_piece_dataset():
    rng = np.random.default_rng(0)
    lengths = [150, 20, 64, 3]
    rows = [{"input_ids": rng.integers(1, 1000, n).tolist(), "position_ids": list(range(n))} for n in lengths]
    for row in rows:
        row["labels"] = list(row["input_ids"])
    dataset = PieceDataset(rows)
    collator = PackedCollator(64)

    def rebuild(mode: str, n_ranks: int) -> dict[int, list[int]]:
        tokens: dict[int, list[tuple[int, list[int]]]] = {}
        for rank in range(n_ranks):
            for bin_ in plan_bins(lengths, 64, overlong=mode, num_replicas=n_ranks, rank=rank):
                features = dataset.__getitems__(bin_)
                out = collator(features)
                cu = out["cu_seq_lens_q"].tolist()
                for k, item in enumerate(bin_):
                    seg_ids = out["input_ids"][0, cu[k] : cu[k + 1]].tolist()
                    seg_labels = out["labels"][0, cu[k] : cu[k + 1]]
                    if isinstance(item, Piece) and item.filler:
                        assert seg_labels.eq(IGNORE).all()
                        continue
                    index, start = (item.index, item.start) if isinstance(item, Piece) else (item, 0)
                    assert dataset[item]["input_ids"] == seg_ids
                    tokens.setdefault(index, []).append((start, seg_ids))
        return {i: [t for _, ids in sorted(parts) for t in ids] for i, parts in tokens.items()}

    split = rebuild("split", 3)
    assert {i: split[i] for i in range(4)} == {i: rows[i]["input_ids"] for i in range(4)}
    truncated = rebuild("truncate", 8)  # 4 bins on 8 ranks: 4 fillers, all masked
    assert truncated[0] == rows[0]["input_ids"][:64]
    assert all(truncated[i] == rows[i]["input_ids"] for i in (1, 2, 3))


def test_collator_is_fast():
    """Guards against per-token Python loops; the real number comes from bench_packer."""
    import time

    rng = np.random.default_rng(0)
    bins = []
    for _ in range(50):
        lengths = rng.integers(1, 800, 10)
        bins.append([{"input_ids": rng.integers(0, 1000, n).tolist()} for n in lengths])
    collator = PackedCollator(8192)
    start = time.perf_counter()
    for b in bins:
        collator(b)
    tokens = sum(len(f["input_ids"]) for b in bins for f in b)
    assert tokens / (time.perf_counter() - start) > 200_000
