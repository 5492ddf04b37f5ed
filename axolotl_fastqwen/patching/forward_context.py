"""State one patched model shares between its decoder pre-hook and its patched layers.

The pre-hook resolves a forward's boundaries once; the causal-LM head reads them afterwards (the
MoE auxiliary loss counts data tokens only), and counts the forwards that had no trainable token
(without a host sync: the count lives on the device until someone reads it).
"""

from __future__ import annotations

import logging

import torch

from ..boundaries import Boundaries
from ..ops.linear_cross_entropy import IGNORE_INDEX

LOG = logging.getLogger("axolotl_fastqwen")


class ForwardContext:
    def __init__(self):
        self.last_boundaries: Boundaries | None = None
        self._empty_forwards: torch.Tensor | None = None  # device counter
        self._reported_empty = 0

    def loss(self, loss_fn, hidden, weight, targets, *, num_items_in_batch=None) -> torch.Tensor:
        """`loss_fn(...)`, counting the training forwards of steps with no trainable token: the
        Trainer's `num_items_in_batch` (its count over the whole accumulation window) is 0, or, when
        the caller passes none, this batch's labels are all -100. Such forwards give a finite zero
        loss and zero gradients (a planned filler row inside a normal step is not counted)."""
        loss = loss_fn(hidden, weight, targets, num_items_in_batch=num_items_in_batch)
        if torch.is_grad_enabled():
            if num_items_in_batch is None:
                empty = (targets.reshape(-1) != IGNORE_INDEX).sum() == 0
            else:
                empty = torch.as_tensor(num_items_in_batch, device=loss.device) == 0
            empty = empty.to(device=loss.device, dtype=torch.long)
            self._empty_forwards = empty if self._empty_forwards is None else self._empty_forwards + empty
        return loss

    def empty_forwards(self) -> int:
        """Training forwards so far with no trainable token (one host sync)."""
        return 0 if self._empty_forwards is None else int(self._empty_forwards)

    def warn_empty_forwards(self) -> int:
        """Log a warning when the count grew since the last call; returns the count."""
        count = self.empty_forwards()
        if count > self._reported_empty:
            LOG.warning(
                "axolotl_fastqwen: %d training forward%s so far belonged to steps with no trainable token "
                "(every label -100, e.g. assistant turns truncated away): loss 0 and zero gradients there, "
                "nothing trained. Check the dataset's masking and sequence_len.", count, "" if count == 1 else "s",
            )
            self._reported_empty = count
        return count
