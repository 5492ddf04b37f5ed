"""One bin of unpadded samples -> one static-shape `[1, token_budget]` packed row.

A static shape means one compiled / autotuned kernel configuration for the whole run (Triton
re-autotunes per new shape). The row carries every form of the sequence boundaries the Qwen hybrid
layers need, all derived from the same lengths so they cannot disagree: `position_ids` (rotary),
`cu_seq_lens_*` (recurrence, varlen attention), `seq_idx` (causal conv) and a host copy of the
boundaries (no device-to-host sync in the model).
"""

from __future__ import annotations

import numpy as np
import torch

from ..boundaries import HOST_CU_SEQLENS_KWARG, PADDING_SEGMENTS_KWARG
from .planner import Item, Piece, check_token_budget

FILLER_KEY = "fastqwen_filler"
HOST_CU_SEQLENS_KEY = HOST_CU_SEQLENS_KWARG  # the model side reads it under this name
_SLICED_KEYS = ("input_ids", "labels", "attention_mask")


def _as_1d(value, key: str, i: int) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        arr = value.detach().cpu().numpy()
    else:
        arr = np.asarray(value)
    if arr.ndim != 1:
        raise ValueError(
            f"feature {i}: {key} must be 1-D (one unpadded sample), got shape {tuple(arr.shape)}"
        )
    if arr.size and not np.issubdtype(arr.dtype, np.integer) and arr.dtype != np.bool_:
        raise ValueError(f"feature {i}: {key} must hold integers, got dtype {arr.dtype}")
    return arr


class PackedCollator:
    """Packs features into one `[1, token_budget]` row; every call returns the same shapes.

    Features: `input_ids` (list[int] or 1-D tensor), optional `labels` (aligned with `input_ids`,
    unshifted: the model shifts), optional `attention_mask` (must be all ones: a 0 means the
    sample was padded), optional `position_ids` (must be 0..n-1), optional `fastqwen_filler`
    (set by `PieceDataset` for filler bins: every label becomes -100). Zero-length features are
    dropped (an empty segment is not a sequence).

    Returns, with B = `token_budget` and R = B - real tokens (the padding tail):

    * `input_ids` long `[1, B]`, tail = `pad_token_id`.
    * `labels` long `[1, B]`: the features' labels (user -100s kept), -100 on the tail and on the
      first token of every packed sequence: after the model's shift, label[t] is predicted from
      token t-1, which there belongs to the previous sequence.
    * `position_ids` long `[1, B]`, restarting at 0 per sequence; the tail counts 0..R-1. 2-D on
      purpose: Qwen3.5's MRoPE has 3 axes, equal to these for text, and transformers expands a
      2-D `position_ids` to the 3 axes itself.
    * `cu_seq_lens_q` / `cu_seq_lens_k` int32 `[S + 1]`, the tail (if any) as its own last
      segment, so they always end at B; `max_length_q` / `max_length_k` Python ints (as
      transformers' `DataCollatorWithFlattening`).
    * `seq_idx` int32 `[1, B]`, segment index per token; the tail has its own index.
    * `fastqwen_cu_seqlens_host`: `cu_seq_lens_q` as a tuple of ints. Trainer/accelerate move
      tensors to the GPU but leave tuples on the host, so the model reads boundaries without a sync.
    * `fastqwen_padding_segments`: indices of the segments that hold no data (the tail, filler
      samples), as a tuple: MoE models leave them out of the router's auxiliary loss.

    No `attention_mask` is emitted: boundaries are explicit. Raises ValueError when the features
    hold more than `token_budget` tokens (the sampler never plans that).
    """

    def __init__(self, token_budget: int, pad_token_id: int = 0, label_pad_token_id: int = -100):
        self.token_budget = check_token_budget(token_budget)
        self.pad_token_id = int(pad_token_id)
        self.label_pad_token_id = int(label_pad_token_id)

    def __call__(self, features: list[dict]) -> dict:
        budget = self.token_budget
        ids_parts: list[np.ndarray] = []
        label_parts: list[np.ndarray] = []
        lengths: list[int] = []
        padding_segments: list[int] = []  # filler samples: real tokens that must train nothing
        for i, feature in enumerate(features):
            ids = _as_1d(feature["input_ids"], "input_ids", i)
            n = ids.size
            if n == 0:
                continue
            labels = feature.get("labels")
            if feature.get(FILLER_KEY):
                labels = np.full(n, self.label_pad_token_id, dtype=np.int64)
                padding_segments.append(len(lengths))
            elif labels is None:
                labels = ids
            else:
                labels = _as_1d(labels, "labels", i)
                if labels.size != n:
                    raise ValueError(f"feature {i}: {labels.size} labels for {n} input_ids; they must align")
            self._check_mask(feature.get("attention_mask"), n, i)
            self._check_positions(feature.get("position_ids"), n, i)
            ids_parts.append(ids)
            label_parts.append(labels)
            lengths.append(n)
        total = sum(lengths)
        if total > budget:
            raise ValueError(
                f"features hold {total} tokens, more than the token budget {budget} "
                f"(fastqwen_token_budget). Feed PackedCollator bins planned by PackedBatchSampler "
                f"for the same budget; overlong samples need fastqwen_overlong: truncate|split."
            )
        if total < budget:
            padding_segments.append(len(lengths))  # the tail
        seg = np.asarray(lengths + ([budget - total] if total < budget else []), dtype=np.int64)
        cu = np.zeros(seg.size + 1, dtype=np.int64)
        np.cumsum(seg, out=cu[1:])
        input_ids = np.full(budget, self.pad_token_id, dtype=np.int64)
        labels = np.full(budget, self.label_pad_token_id, dtype=np.int64)
        if lengths:
            input_ids[:total] = np.concatenate(ids_parts)
            labels[:total] = np.concatenate(label_parts)
            labels[cu[: len(lengths)]] = self.label_pad_token_id
        starts = np.repeat(cu[:-1], seg)
        position_ids = np.arange(budget, dtype=np.int64) - starts
        seq_idx = np.repeat(np.arange(seg.size, dtype=np.int32), seg)
        cu32 = torch.from_numpy(cu.astype(np.int32))
        max_length = int(seg.max())
        return {
            "input_ids": torch.from_numpy(input_ids).view(1, budget),
            "labels": torch.from_numpy(labels).view(1, budget),
            "position_ids": torch.from_numpy(position_ids).view(1, budget),
            "cu_seq_lens_q": cu32,
            "cu_seq_lens_k": cu32.clone(),
            "max_length_q": max_length,
            "max_length_k": max_length,
            "seq_idx": torch.from_numpy(seq_idx).view(1, budget),
            HOST_CU_SEQLENS_KEY: tuple(cu.tolist()),
            PADDING_SEGMENTS_KWARG: tuple(padding_segments),
        }

    @staticmethod
    def _check_mask(mask, n: int, i: int) -> None:
        if mask is None:
            return
        mask = _as_1d(mask, "attention_mask", i)
        if mask.size != n:
            raise ValueError(f"feature {i}: attention_mask has {mask.size} entries for {n} input_ids")
        bad = np.flatnonzero(mask != 1)
        if bad.size:
            j = int(bad[0])
            raise ValueError(
                f"feature {i}: attention_mask[{j}] = {int(mask[j])}; a 0 inside a sample means it was "
                f"padded (left or right). PackedCollator packs unpadded samples: tokenize with "
                f"padding=False (or strip the padding) before packing."
            )

    @staticmethod
    def _check_positions(positions, n: int, i: int) -> None:
        if positions is None:
            return
        positions = _as_1d(positions, "position_ids", i)
        if positions.size != n:
            raise ValueError(f"feature {i}: position_ids has {positions.size} entries for {n} input_ids")
        bad = np.flatnonzero(positions != np.arange(n))
        if bad.size:
            j = int(bad[0])
            raise ValueError(
                f"feature {i}: position_ids[{j}] = {int(positions[j])}, expected {j}: each feature must "
                f"be one unpacked sample with position_ids 0..{n - 1}. Drop the position_ids column "
                f"(PackedCollator computes them) or unpack the sample first."
            )


def resolve_item(item: Item, row: dict) -> dict:
    """The feature one bin item stands for: the row itself, or a slice / filler of it."""
    if not isinstance(item, Piece):
        return row
    row = dict(row)
    for key in _SLICED_KEYS:
        if row.get(key) is not None:
            row[key] = row[key][item.start : item.stop]
    if row.get("position_ids") is not None:
        row["position_ids"] = np.asarray(row["position_ids"][item.start : item.stop]) - item.start
    if "length" in row:
        row["length"] = item.stop - item.start
    if item.filler:
        row[FILLER_KEY] = True
    return row


class PieceDataset(torch.utils.data.Dataset):
    """Wraps a map-style dataset so a DataLoader can fetch `PackedBatchSampler` bins holding `Piece`s.

    Plain `int` items pass straight through (batched via the inner `__getitems__` when it has one,
    as Hugging Face datasets do). A `Piece` fetches its sample and slices `input_ids`, `labels` and
    `attention_mask` to `[start, stop)` (re-basing any `position_ids`); a filler piece is also
    marked `fastqwen_filler` so `PackedCollator` masks all its labels. Needed whenever the plan can
    hold pieces: `overlong` truncate/split, or fewer multi-sample bins than ranks need (fillers).
    """

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, item: Item) -> dict:
        index = item.index if isinstance(item, Piece) else int(item)
        return resolve_item(item, self.dataset[index])

    def __getitems__(self, items: list[Item]) -> list[dict]:
        indices = [item.index if isinstance(item, Piece) else int(item) for item in items]
        getitems = getattr(self.dataset, "__getitems__", None)
        rows = getitems(indices) if getitems is not None else [self.dataset[i] for i in indices]
        return [resolve_item(item, row) for item, row in zip(items, rows)]
