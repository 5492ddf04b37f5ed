"""One deterministic token stream, cut into each path's batch layout from the same sequence order.

Three streams (`STREAMS`): `sft` (the default), lengths lognormal (median ~500, SFT-like) clipped
to [32, min(2048, budget/2)]: short sequences packed long; `long`, lengths log-uniform from
min(8192, budget/4) to the whole row: long-context fine-tuning, one to a few sequences a row;
`single`, every sequence exactly the row: the longest sequence a step can train. Token ids are
random. The stream is planned once into packed rows (`PackedBatchSampler`); the concatenation of
those rows is THE sequence order: packed paths take one row per step, padded paths take
`micro_batch_size` consecutive sequences of the same order per step. The first row is also the
calibration set on which every path's loss must agree.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import torch

from axolotl_fastqwen.packing import PackedBatchSampler, PackedCollator

IGNORE = -100
PAD_ID = 0
LAYOUTS = ("padded", "flattening", "multipack", "packed")
STREAMS = ("sft", "long", "single")
LONG_MIN = 8192  # the shortest sequence of the `long` stream (or a quarter of the row, if less)


@dataclass
class Workload:
    """The stream and its packed plan. `bins[i]`: sequence indices of packed step i."""

    budget: int
    vocab_size: int
    seed: int
    lengths: np.ndarray
    bins: list[list[int]]
    median: float
    sigma: float
    min_len: int
    max_len: int
    stream: str = "sft"

    @property
    def order(self) -> list[int]:
        return [i for b in self.bins for i in b]

    def tokens(self, i: int) -> np.ndarray:
        return _tokens(self.seed, int(i), int(self.lengths[i]), self.vocab_size)

    def default_micro_batch_size(self, steps: int) -> int:
        """Mean number of sequences in a packed row: a padded step then holds about as many real
        tokens as a packed one (but pads each sequence to the longest of its batch)."""
        bins = self.bins[: max(1, steps)]
        return max(1, round(sum(len(b) for b in bins) / len(bins)))

    def steps(self, layout: str, n: int, micro_batch_size: int) -> list[list[int]]:
        """Sequence indices of the first `n` steps of `layout`."""
        if layout == "padded":
            order = self.order
            if n * micro_batch_size > len(order):
                raise ValueError(f"stream too short for {n} padded steps of {micro_batch_size}")
            return [order[i * micro_batch_size : (i + 1) * micro_batch_size] for i in range(n)]
        if n > len(self.bins):
            raise ValueError(f"stream too short for {n} packed steps")
        return [list(b) for b in self.bins[:n]]

    def calibration(self, layout: str, micro_batch_size: int) -> list[list[int]]:
        """The first packed row's sequences: one row for packed layouts, `micro_batch_size` chunks
        for padded ones."""
        first = list(self.bins[0])
        if layout == "padded":
            return [first[i : i + micro_batch_size] for i in range(0, len(first), micro_batch_size)]
        return [first]

    def describe(self) -> dict:
        distribution = {
            "sft": f"lognormal(median {self.median:g}, sigma {self.sigma:g}) clipped to [{self.min_len}, {self.max_len}]",
            "long": f"log-uniform over [{self.min_len}, {self.max_len}]",
            "single": f"every sequence {self.max_len} tokens (one a row)",
        }[self.stream]
        return {
            "stream": self.stream,
            "sequences": int(len(self.lengths)),
            "tokens": int(self.lengths.sum()),
            "length_distribution": distribution,
            "length_mean": round(float(self.lengths.mean()), 1),
            "length_median": float(np.median(self.lengths)),
            "packed_rows": len(self.bins),
            "packed_fill": round(float(self.lengths.sum()) / (len(self.bins) * self.budget), 4),
            "calibration_sequences": len(self.bins[0]),
            "calibration_tokens": int(self.lengths[self.bins[0]].sum()),
        }


def _tokens(seed: int, index: int, length: int, vocab_size: int) -> np.ndarray:
    return np.random.default_rng([seed, 7, index]).integers(0, vocab_size, length, dtype=np.int64)


def make_workload(
    *,
    budget: int,
    vocab_size: int,
    steps: int,
    seed: int = 0,
    median: float = 500.0,
    sigma: float = 0.8,
    min_len: int = 32,
    max_len: int | None = None,
    micro_batch_size: int | None = None,
    stream: str = "sft",
) -> Workload:
    """Enough sequences for `steps` packed rows and `steps` padded batches (with slack).

    Lengths are drawn in blocks from one generator, so a longer stream extends a shorter one.
    `sft`: when the cap is under 4x the median (small budgets), the median is lowered to cap/4.
    `long` and `single` ignore `median`, `sigma`, `min_len` and `max_len` (see the module's doc).
    """
    if stream not in STREAMS:
        raise ValueError(f"unknown stream {stream!r}; one of {', '.join(STREAMS)}")
    if stream == "sft":
        max_len = min(2048, budget // 2) if max_len is None else int(max_len)
        min_len = min(min_len, max_len)
        median = min(float(median), max_len / 4) if max_len < 4 * median else float(median)
    else:
        max_len = budget
        min_len = budget if stream == "single" else min(LONG_MIN, budget // 4)
        median, sigma = float(round(math.sqrt(min_len * max_len))), 0.0
    rng = np.random.default_rng([seed, 3])
    want_tokens = (steps + 2) * budget * 1.25
    want_seqs = steps * (micro_batch_size or 1) + 1
    blocks = []
    while not blocks or (sum(b.sum() for b in blocks) < want_tokens or sum(b.size for b in blocks) < want_seqs):
        if stream == "sft":
            raw = rng.lognormal(mean=math.log(median), sigma=sigma, size=256)
        else:  # log-uniform; `single` has min_len == max_len
            raw = np.exp(rng.uniform(math.log(min_len), math.log(max_len), size=256))
        blocks.append(np.clip(np.rint(raw), min_len, max_len).astype(np.int64))
    lengths = np.concatenate(blocks)
    sampler = PackedBatchSampler(lengths, budget, seed=seed, num_replicas=1, interleave_replicas=False)
    bins = [[int(i) for i in b] for b in sampler]
    return Workload(budget, vocab_size, seed, lengths, bins, median, sigma, min_len, max_len, stream)


# --------------------------------------------------------------------------------------------
# Layouts: one function per batch format. Each returns (batch dict of CPU tensors, real tokens).
# --------------------------------------------------------------------------------------------


def padded_batch(seqs: list[np.ndarray]) -> dict:
    """HF default: right-pad to the longest sequence of the batch, attention_mask, -100 labels."""
    T = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), PAD_ID, dtype=torch.long)
    mask = torch.zeros((len(seqs), T), dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, : len(s)] = torch.from_numpy(s)
        mask[b, : len(s)] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, IGNORE)}


def packed_batch(seqs: list[np.ndarray], budget: int) -> dict:
    """This project's static [1, budget] row (boundaries as cu_seq_lens, seq_idx and a host copy)."""
    return PackedCollator(budget, pad_token_id=PAD_ID)([{"input_ids": s} for s in seqs])


def flattening_batch(seqs: list[np.ndarray]) -> dict:
    """transformers' DataCollatorWithFlattening: [1, sum of lengths], a new shape every step."""
    from transformers import DataCollatorWithFlattening

    collator = DataCollatorWithFlattening(
        return_flash_attn_kwargs=True, return_seq_idx=True, return_position_ids=True
    )
    return collator([{"input_ids": s.tolist(), "labels": s.tolist()} for s in seqs])


@functools.cache
def _local_tokenizer():
    """A tokenizer object for Axolotl's collator, built offline: only `pad` and `padding_side` are used."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(WordLevel({"<pad>": PAD_ID, "<unk>": 1}, unk_token="<unk>"))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", padding_side="right")


def multipack_batch(seqs: list[np.ndarray], budget: int) -> tuple[dict, str]:
    """Axolotl 0.21's multipack row: [1, budget], position_ids restart per sequence, the padding tail
    counts 0..R-1, labels are NOT masked at sequence starts, no attention_mask (Axolotl's
    `sample_packing_drop_attention_mask`). Built by Axolotl's own V2BatchSamplerDataCollatorForSeq2Seq
    when it imports, else reproduced here. Returns (batch, which)."""
    features = [
        {"input_ids": s, "labels": s.copy(), "position_ids": np.arange(len(s), dtype=np.int64)} for s in seqs
    ]
    try:
        from axolotl.utils.collators.batching import V2BatchSamplerDataCollatorForSeq2Seq

        collator = V2BatchSamplerDataCollatorForSeq2Seq(
            _local_tokenizer(), padding=True, pad_to_multiple_of=budget, return_tensors="pt"
        )
        out = collator([features])
        batch = {k: out[k] for k in ("input_ids", "labels", "position_ids")}
        return batch, "axolotl V2BatchSamplerDataCollatorForSeq2Seq"
    except Exception:  # a partial Axolotl install: reproduce its layout
        pass
    total = sum(len(s) for s in seqs)
    width = -(-total // budget) * budget
    ids = np.full(width, PAD_ID, dtype=np.int64)
    labels = np.full(width, IGNORE, dtype=np.int64)
    ids[:total] = np.concatenate(seqs)
    labels[:total] = ids[:total]
    pos = np.concatenate([np.arange(len(s)) for s in seqs] + [np.arange(width - total)])
    columns = (("input_ids", ids), ("labels", labels), ("position_ids", pos))
    batch = {k: torch.from_numpy(v).view(1, -1) for k, v in columns}
    return batch, "reproduced Axolotl multipack layout (its collator did not import)"


def collate(layout: str, seqs: list[np.ndarray], budget: int, *, calibration: bool = False) -> dict:
    """The batch of `layout` for `seqs`. `calibration=True` masks the label at every sequence start
    (Axolotl's rows otherwise train on predicting a sequence's first token from the previous
    sequence), so every layout scores exactly the same sum(L - 1) targets."""
    if layout == "padded":
        return padded_batch(seqs)
    if layout == "packed":
        return packed_batch(seqs, budget)
    if layout == "flattening":
        return flattening_batch(seqs)
    if layout == "multipack":
        batch, _ = multipack_batch(seqs, budget)
        if calibration:
            total = sum(len(s) for s in seqs)
            starts = np.cumsum([0] + [len(s) for s in seqs[:-1]])
            labels = batch["labels"].clone()
            labels[0, torch.from_numpy(starts)] = IGNORE
            labels[0, total:] = IGNORE
            batch["labels"] = labels
        return batch
    raise ValueError(f"unknown layout {layout!r}; known: {LAYOUTS}")


def targets(batch: dict) -> int:
    """Tokens that count in the loss: labels that are not -100 after the causal shift."""
    return int((batch["labels"][..., 1:] != IGNORE).sum())


def slots(batch: dict) -> int:
    """Token positions the model computes (real + padding)."""
    return int(batch["input_ids"].numel())


def to_device(batch: dict, device: torch.device) -> dict:
    """Tensors to the device (non-blocking); ints and the host boundary tuple stay on the host."""
    return {k: (v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
