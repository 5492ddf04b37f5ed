"""A test-only Axolotl plugin that records what each rank trained on.

Named in a test YAML (`plugins: [axolotl_fastqwen.FastQwenPlugin, fastqwen_probe.ProbePlugin]`,
with tests/ on PYTHONPATH). For every micro-batch it appends one JSON line to
`<output_dir>/probe-rank<r>.jsonl`: global step, the hashes of the packed sequences (split at the
batch's own boundaries) and the loss. Tests compare these across ranks, runs and resumes.
"""

from __future__ import annotations

import hashlib
import json
import os
import types
from pathlib import Path

from axolotl.integrations.base import BasePlugin


def sequence_hashes(batch) -> list[str]:
    ids = batch["input_ids"].reshape(-1).tolist()
    labels = batch["labels"].reshape(-1).tolist()
    cu = list(batch["fastqwen_cu_seqlens_host"]) if "fastqwen_cu_seqlens_host" in batch else None
    if cu is None:
        cu = batch["cu_seq_lens_q"].tolist()
    out = []
    for start, end in zip(cu[:-1], cu[1:]):
        if all(label == -100 for label in labels[start:end]):
            continue  # the padding tail (or a filler): trains nothing
        out.append(hashlib.sha1(repr(ids[start:end]).encode()).hexdigest()[:16])
    return out


class ProbePlugin(BasePlugin):
    def post_trainer_create(self, cfg, trainer):
        rank = int(os.environ.get("RANK", 0))
        path = Path(cfg.output_dir) / f"probe-rank{rank}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        original = trainer.compute_loss

        def compute_loss(self, model, inputs, *args, **kwargs):
            result = original(model, inputs, *args, **kwargs)
            loss = result[0] if isinstance(result, tuple) else result
            if model.training:
                with path.open("a") as f:
                    f.write(json.dumps({"step": self.state.global_step, "rank": rank, "seqs": sequence_hashes(inputs),
                                        "loss": float(loss.detach())}) + "\n")
            return result

        trainer.compute_loss = types.MethodType(compute_loss, trainer)
