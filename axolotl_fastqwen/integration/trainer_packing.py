"""Wiring the packer into Axolotl's trainer: its collator signature, its samplers, its step count,
and the packing summary against the rows the YAML asked for.

Kept apart from the packer itself (which needs neither Axolotl nor transformers) so that
`axolotl_fastqwen.packing` stays usable with any Trainer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
import types

import numpy as np

from ..packing.collator import PackedCollator, resolve_item
from ..packing.multimodal import MODALITIES, MultimodalPackedCollator
from ..packing.planner import Piece, overlong_message, pieces
from ..packing.sampler import PackedBatchSampler
from ..packing.stats import packing_stats
from .settings import Settings

LOG = logging.getLogger("axolotl_fastqwen")

# keyword arguments Axolotl's builder passes to every collator; the packer has no use for them
_AXOLOTL_COLLATOR_KWARGS = {"padding", "pad_to_multiple_of", "return_tensors", "emit_fa_varlen_kwargs"}


class AxolotlPackedCollator(PackedCollator):
    """`PackedCollator` under Axolotl's calling convention: `cls(tokenizer, padding=..., ...)`."""

    def __init__(self, tokenizer=None, *, token_budget: int, **kwargs):
        unknown = set(kwargs) - _AXOLOTL_COLLATOR_KWARGS
        if unknown:
            LOG.debug("axolotl_fastqwen: collator ignores %s", sorted(unknown))
        pad = getattr(tokenizer, "pad_token_id", None)
        if pad is None:
            pad = getattr(tokenizer, "eos_token_id", None) or 0
        super().__init__(token_budget, pad_token_id=pad)


class AxolotlPackedBatchSampler(PackedBatchSampler):
    """The packed sampler, yielding plain index lists only.

    Overlong samples are cut before planning (`fit_to_budget`), so the plan holds no `Piece`
    except fillers; a filler bin is yielded empty and the collator turns it into an all-padding
    row whose labels are all -100 (a real, lossless forward).
    """

    def __iter__(self):
        for bin_ in super().__iter__():
            yield [item for item in bin_ if not (isinstance(item, Piece) and item.filler)]


def fit_to_budget(dataset, token_budget: int, mode: str, describe=None) -> tuple[object, dict]:
    """Apply `fastqwen_overlong` to a tokenized `datasets.Dataset`; returns it and what was cut.

    `error` raises, naming the samples (`describe(index)` says where each comes from); `truncate`
    keeps each overlong sample's first `token_budget` tokens; `split` makes consecutive pieces of
    at most `token_budget` tokens, each its own sample (position_ids restart in each piece). The
    pieces are the planner's (`planner.pieces`), cut as `PieceDataset` cuts them (`resolve_item`):
    materialised here because Axolotl's dataloader wants a `datasets.Dataset`.
    """
    lengths = _lengths(dataset)
    over = lengths > token_budget
    cut = {"mode": mode, "overlong_samples": int(over.sum()), "tokens_in_overlong": int(lengths[over].sum())}
    if not over.any():
        return dataset, cut
    if mode == "error":
        raise ValueError(overlong_message(lengths, token_budget, describe))
    sample, start, stop, _ = pieces(lengths, token_budget, mode)
    if mode == "truncate":
        cut["tokens_dropped"] = int((lengths[over] - token_budget).sum())
    else:
        cut["pieces"] = int(np.isin(sample, np.flatnonzero(over)).sum())
    rows = dataset.select(sample.tolist())
    bounds = np.stack([start, stop], axis=1).tolist()

    def cut_rows(batch, indices):
        keys = list(batch)
        out = {k: [] for k in keys}
        for j, i in enumerate(indices):
            row = resolve_item(Piece(int(sample[i]), *bounds[i]), {k: batch[k][j] for k in keys})
            for k in keys:
                out[k].append(row[k])
        return out

    return rows.map(cut_rows, batched=True, with_indices=True, desc=f"fastqwen_overlong: {mode}"), cut


def describe_cut(cut: dict) -> str:
    """One log line for what `fit_to_budget` did."""
    n = cut["overlong_samples"]
    if not n:
        return "no sample longer than the token budget"
    samples = f"{n} sample{'s' if n != 1 else ''} longer than the token budget ({cut['tokens_in_overlong']:,} tokens)"
    if cut["mode"] == "truncate":
        return f"{samples} truncated: {cut['tokens_dropped']:,} tokens dropped"
    return f"{samples} split into {cut['pieces']} pieces"


def sample_origin(dataset, tokenizer=None):
    """`describe(index)` for error messages: the row before Axolotl's shuffle (when the dataset
    still carries its shuffle's index map) and how the sample begins, so it can be found."""

    def describe(i: int) -> str:
        parts = []
        indices = getattr(dataset, "_indices", None)
        if indices is not None:
            parts.append(f"row {indices.column(0)[i].as_py()} before shuffling")
        if tokenizer is not None:
            with contextlib.suppress(Exception):
                text = tokenizer.decode(dataset[i]["input_ids"][:24])
                parts.append(f"begins {text[:80]!r}")
        return ", ".join(parts)

    return describe


def _lengths(dataset) -> np.ndarray:
    from axolotl.utils.samplers.utils import get_dataset_lengths

    return np.asarray(get_dataset_lengths(dataset))


def install_packed_sampler(trainer, settings: Settings) -> dict:
    """Give `trainer` the packed batch samplers (train, and eval unless `settings.pack_eval` is off)
    and the exact step count.

    Returns the packing report (per epoch: samples, tokens, bins, padding, reduction vs padded
    batches of `micro_batch_size` and vs the rows the YAML asked for), which is also logged.
    """
    budget, mode = settings.token_budget, settings.overlong
    seed = trainer.args.data_seed if getattr(trainer.args, "data_seed", None) is not None else trainer.args.seed
    replicas = trainer._data_parallel_size() if hasattr(trainer, "_data_parallel_size") else trainer.args.world_size

    tokenizer = getattr(trainer, "processing_class", None) or getattr(trainer, "tokenizer", None)
    trainer.train_dataset, train_cut = fit_to_budget(
        trainer.train_dataset, budget, mode, sample_origin(trainer.train_dataset, tokenizer))
    LOG.info("axolotl_fastqwen: training set: %s", describe_cut(train_cut))
    train_sampler = AxolotlPackedBatchSampler(_lengths(trainer.train_dataset), budget, seed=seed, num_replicas=replicas)
    eval_samplers = {}

    def train_sampler_fn(self, train_dataset=None):
        return train_sampler

    def eval_sampler_fn(self, eval_dataset=None):
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if dataset is None:
            return None
        key = id(dataset)
        if key not in eval_samplers:
            eval_samplers[key] = AxolotlPackedBatchSampler(_lengths(dataset), budget, seed=seed, num_replicas=replicas)
        return eval_samplers[key]

    trainer._get_train_sampler = types.MethodType(train_sampler_fn, trainer)
    eval_cut = None
    if settings.pack_eval:
        trainer._get_eval_sampler = types.MethodType(eval_sampler_fn, trainer)
        if hasattr(trainer.eval_dataset, "column_names"):
            trainer.eval_dataset, eval_cut = fit_to_budget(
                trainer.eval_dataset, budget, mode, sample_origin(trainer.eval_dataset, tokenizer))
            LOG.info("axolotl_fastqwen: evaluation set: %s", describe_cut(eval_cut))
    _forward_epochs_on_resume(trainer)

    report = _report(trainer, settings, train_sampler, replicas)
    report["overlong_train"], report["overlong_eval"] = train_cut, eval_cut
    _exact_steps(trainer, settings, len(train_sampler) // replicas)
    report["optimizer_steps"] = trainer.args.max_steps
    return report


def _forward_epochs_on_resume(trainer) -> None:
    """accelerate forwards `set_epoch` to the sampler, except through the `SkipBatchSampler` a
    mid-epoch resume wraps it in; Axolotl's `_run_epoch` receives the epoch number, so set it there."""
    run_epoch = getattr(trainer, "_run_epoch", None)
    if run_epoch is None:
        return

    def _run_epoch(self, model, epoch, train_dataloader, **kwargs):
        pending, seen = [train_dataloader], set()
        while pending:
            current = pending.pop()
            if current is None or id(current) in seen:
                continue
            seen.add(id(current))
            if isinstance(current, PackedBatchSampler):
                current.set_epoch(epoch)
            pending += [getattr(current, a, None) for a in ("batch_sampler", "sampler", "base_dataloader")]
        return run_epoch(model, epoch, train_dataloader, **kwargs)

    trainer._run_epoch = types.MethodType(_run_epoch, trainer)


def _exact_steps(trainer, settings: Settings, batches_per_rank: int) -> None:
    """Axolotl sized the run for unpacked batches of micro_batch_size; size it for the packed rows."""
    if settings.step_count_fixed:
        return
    accum = max(1, int(trainer.args.gradient_accumulation_steps))
    per_epoch = max(1, math.ceil(batches_per_rank / accum))
    total = math.ceil(per_epoch * float(trainer.args.num_train_epochs))
    trainer.args.max_steps = total
    if settings.warmup_steps is None:  # Axolotl's own rule, on the true step count
        ratio = settings.warmup_ratio
        warmup = max(int(ratio * total), 0) if ratio is not None else min(int(0.03 * total), 100)
        trainer.args.warmup_steps = 2 if warmup == 1 else warmup
    LOG.info("axolotl_fastqwen: %d packed rows per rank per epoch -> max_steps %d", batches_per_rank, total)


def multipack_batches(lengths: np.ndarray, settings: Settings, seed: int) -> int | None:
    """The micro-batches Axolotl's multipack would have run for one epoch on one rank
    (`micro_batch_size` bins of `sequence_len` each, its default bin size, one process), for the
    packing summary; None if its sampler cannot be built here."""
    try:
        import torch
        from axolotl.utils.samplers.multipack import MultipackBatchSampler

        base = torch.utils.data.RandomSampler(range(lengths.size), generator=torch.Generator().manual_seed(seed))
        sampler = MultipackBatchSampler(base, batch_size=settings.micro_batch_size,
                                        batch_max_len=settings.sequence_len, lengths=lengths, bin_size=200,
                                        num_processes=1, drop_last=True, seed=seed)
        return len(sampler.generate_batches())
    except Exception as exc:  # noqa: BLE001 - a summary line is not worth failing the run for
        LOG.debug("axolotl_fastqwen: multipack's batch count not computed (%s)", exc)
        return None


def _report(trainer, settings: Settings, sampler, replicas) -> dict:
    lengths = sampler.lengths
    epochs = max(1, math.ceil(float(trainer.args.num_train_epochs or 1)))
    mbs = settings.micro_batch_size
    multipack = (multipack_batches(lengths[lengths <= settings.sequence_len], settings, sampler.seed)
                 if settings.user_rows == "multipack" else None)
    per_epoch = []
    for epoch in range(min(epochs, 8)):
        stats = packing_stats(lengths, settings.token_budget, mbs, seed=sampler.seed, epoch=epoch,
                              num_replicas=replicas)
        LOG.info("axolotl_fastqwen: epoch %d: %s", epoch, stats.format())
        per_epoch.append({
            **dataclasses.asdict(stats),
            "padding_fraction": stats.padding_fraction,
            "reduction_vs_padded_pct": stats.reduction_pct,
            "over_lower_bound_pct": stats.over_lower_bound_pct,
        })
    report = {"active": True, "token_budget": settings.token_budget, "row_shape": [1, settings.token_budget],
              "replicas": replicas, "overlong": settings.overlong, "pack_eval": settings.pack_eval,
              "replaced": settings.user_rows, "epochs": per_epoch}
    if multipack is not None:
        report["multipack"] = {"micro_batches": multipack, "micro_batch_size": mbs,
                               "sequence_len": settings.sequence_len}
        LOG.info("axolotl_fastqwen: Axolotl's multipack would have run %d micro-batches of %d x %d tokens in "
                 "epoch 0; the packer runs %d rows of %d", multipack, mbs, settings.sequence_len,
                 per_epoch[0]["bins"], settings.token_budget)
    return report


# ---- image + text samples ---------------------------------------------------------------------
PER_TOKEN = ("input_ids", "labels", "attention_mask", "mm_token_type_ids")  # [1, L] in a one-sample batch


class MultimodalBins:
    """Axolotl's multimodal collator (its processing strategy: chat template, image loading,
    assistant-only labels) run on each sample of a bin alone, unpadded, then packed into one row."""

    def __init__(self, processor_collator, packer: MultimodalPackedCollator):
        self.processor_collator, self.packer = processor_collator, packer

    def process(self, example: dict) -> dict:
        batch = self.processor_collator([example])
        return {k: (v[0] if k in PER_TOKEN else v) for k, v in batch.items()}

    def __call__(self, examples: list[dict]) -> dict:
        return self.packer([self.process(e) for e in examples])


def _processed_lengths(bins: MultimodalBins, dataset, budget: int) -> tuple[np.ndarray, dict]:
    """Every sample processed once, as the collator will process it, and checked as the packer will
    check it (placeholders against grids: an error names the dataset index before the first step):
    its length in the row, and the images and vision tokens for the report. An image is never split:
    an overlong sample is an error naming it."""
    lengths, images, vision = [], 0, 0
    for i in range(len(dataset)):
        sample = bins.process(dataset[i])
        bins.packer.sample(i, sample)
        lengths.append(int(sample["input_ids"].numel()))
        images += sum(int(sample[grid].shape[0]) for _, grid, _ in MODALITIES if sample.get(grid) is not None)
        vision += int((sample["mm_token_type_ids"] != 0).sum())
    lengths = np.asarray(lengths, dtype=np.int64)
    over = np.flatnonzero(lengths > budget)
    if over.size:
        worst = over[np.argsort(-lengths[over])][:3]
        raise ValueError(
            f"{over.size} image+text sample{'s are' if over.size > 1 else ' is'} longer than the token budget of "
            f"{budget}: " + ", ".join(f"dataset index {int(i)} ({int(lengths[i])} tokens)" for i in worst)
            + ". An image is never split: raise fastqwen_token_budget (or sequence_len), or give the processor a "
            "smaller max_pixels.")
    return lengths, {"images": images, "vision_tokens": vision}


def install_multimodal_packer(trainer, settings: Settings, rope_index, *, image_token_id: int,
                              video_token_id: int | None, merge_size: int) -> dict:
    """The packer for image+text data: Axolotl's multimodal collator processes each sample of a bin
    alone, `MultimodalPackedCollator` packs them; lengths come from processing every sample once."""
    processor_collator = trainer.data_collator
    if not hasattr(processor_collator, "processing_strategy"):
        raise ValueError(
            f"image+text packing wraps Axolotl's multimodal collator, but the trainer's collator is "
            f"{type(processor_collator).__name__}: set processor_type: AutoProcessor and skip_prepare_dataset: true "
            "(Axolotl's vision examples), or fastqwen_packing: false.")
    tokenizer = getattr(trainer, "processing_class", None) or getattr(processor_collator, "tokenizer", None)
    pad = getattr(getattr(tokenizer, "tokenizer", tokenizer), "pad_token_id", None) or 0
    packer = MultimodalPackedCollator(settings.token_budget, rope_index=rope_index, image_token_id=image_token_id,
                                      video_token_id=video_token_id, merge_size=merge_size, pad_token_id=pad)
    bins = MultimodalBins(processor_collator, packer)
    seed = trainer.args.data_seed if getattr(trainer.args, "data_seed", None) is not None else trainer.args.seed
    replicas = trainer._data_parallel_size() if hasattr(trainer, "_data_parallel_size") else trainer.args.world_size
    started = time.perf_counter()
    lengths, vision = _processed_lengths(bins, trainer.train_dataset, settings.token_budget)
    LOG.info("axolotl_fastqwen: %d image+text samples processed once for their lengths in %.1f s: %d images, %d "
             "vision tokens", lengths.size, time.perf_counter() - started, vision["images"], vision["vision_tokens"])
    train_sampler = AxolotlPackedBatchSampler(lengths, settings.token_budget, seed=seed, num_replicas=replicas)
    trainer._get_train_sampler = types.MethodType(lambda self, train_dataset=None: train_sampler, trainer)
    trainer.data_collator = trainer.train_data_collator = bins
    if settings.pack_eval and trainer.eval_dataset is not None:
        eval_lengths, _ = _processed_lengths(bins, trainer.eval_dataset, settings.token_budget)
        eval_sampler = AxolotlPackedBatchSampler(eval_lengths, settings.token_budget, seed=seed, num_replicas=replicas)
        trainer._get_eval_sampler = types.MethodType(lambda self, eval_dataset=None: eval_sampler, trainer)
        trainer.eval_data_collator = bins
    _forward_epochs_on_resume(trainer)
    report = _report(trainer, settings, train_sampler, replicas)
    rows = max(1, report["epochs"][0]["bins"])
    report["multimodal"] = {**vision, "images_per_row": round(vision["images"] / rows, 2),
                            "vision_tokens_per_row": round(vision["vision_tokens"] / rows, 1),
                            "lengths_from": "each sample processed once by Axolotl's multimodal collator"}
    _exact_steps(trainer, settings, len(train_sampler) // replicas)
    report["optimizer_steps"] = trainer.args.max_steps
    return report

