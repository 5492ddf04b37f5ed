"""A test-only Axolotl plugin that records what each rank trained on.

Named in a test YAML (`plugins: [axolotl_fastqwen.FastQwenPlugin, fastqwen_probe.ProbePlugin]`,
with tests/ on PYTHONPATH). For every training micro-batch it appends one JSON line to
`<output_dir>/probe-rank<r>.jsonl`: the global step, the hashes of the packed sequences (split at
the batch's own boundaries), their tokens and labels, the `num_items_in_batch` the model was given
and the loss the model returned. Tests compare these across ranks, runs and resumes, and against
stock transformers run on the recorded sequences.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from axolotl.integrations.base import BasePlugin


def segments(batch) -> list[tuple[list[int], list[int]]]:
    """(input_ids, labels) of every packed sequence that trains something (not the padding tail)."""
    ids = batch["input_ids"].reshape(-1).tolist()
    labels = batch["labels"].reshape(-1).tolist()
    cu = list(batch["fastqwen_cu_seqlens_host"]) if "fastqwen_cu_seqlens_host" in batch else None
    if cu is None:
        cu = batch["cu_seq_lens_q"].tolist()
    out = []
    for start, end in zip(cu[:-1], cu[1:]):
        if all(label == -100 for label in labels[start:end]):
            continue  # the padding tail (or a filler): trains nothing
        out.append((ids[start:end], labels[start:end]))
    return out


def sequence_hashes(batch) -> list[str]:
    return [hashlib.sha1(repr(ids).encode()).hexdigest()[:16] for ids, _ in segments(batch)]


class ProbePlugin(BasePlugin):
    def post_trainer_create(self, cfg, trainer):
        rank = int(os.environ.get("RANK", 0))
        path = Path(cfg.output_dir) / f"probe-rank{rank}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)

        def record(module, args, kwargs, output):
            if not module.training or kwargs.get("labels") is None:
                return
            n = kwargs.get("num_items_in_batch")
            row = {"step": trainer.state.global_step, "rank": rank, "seqs": sequence_hashes(kwargs),
                   "segments": segments(kwargs), "num_items_in_batch": None if n is None else int(n),
                   "loss": float(output.loss.detach())}
            with path.open("a") as f:
                f.write(json.dumps(row) + "\n")

        trainer.model.register_forward_hook(record, with_kwargs=True)
