"""The plugin's trainer callbacks: `fastqwen_checkpointing: auto` around every optimizer step, and
the report kept current (a warning at each log step with steps that had no trainable token; the
report re-written at the end with what the run saw)."""

from __future__ import annotations

import logging
from collections.abc import Callable

from transformers import TrainerCallback

from ..memory.checkpoint_fitter import CheckpointFitter, memory_of
from ..devices import training_device

LOG = logging.getLogger("axolotl_fastqwen")


class FitCheckpointing(TrainerCallback):
    """Runs a `CheckpointFitter` (memory/checkpoint_fitter.py). Built at train begin: the Trainer turns
    gradient checkpointing on just before it. `fitter` is read by the report."""

    def __init__(self, memory_fraction: float):
        self.memory_fraction = memory_fraction
        self.fitter: CheckpointFitter | None = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.fitter = CheckpointFitter(model, memory_of(training_device()), fraction=self.memory_fraction)
        LOG.info("axolotl_fastqwen: fastqwen_checkpointing: auto: %s", self.fitter.summary())

    def on_step_begin(self, args, state, control, **kwargs):
        if self.fitter is not None:
            self.fitter.step_begin()

    def on_step_end(self, args, state, control, **kwargs):
        if self.fitter is not None:
            self.fitter.step_end()

    def on_train_end(self, args, state, control, **kwargs):
        if self.fitter is not None:
            LOG.info("axolotl_fastqwen: checkpointing: %s", self.fitter.summary())
            self.fitter.restore()


class KeepReport(TrainerCallback):
    """Warns at each log step when steps without a trainable token occurred (`context`: the
    patched model's `ForwardContext`), and calls `write()` once training ends."""

    def __init__(self, context, write: Callable[[], None]):
        self.context, self.write = context, write

    def on_log(self, args, state, control, **kwargs):
        if self.context is not None:
            self.context.warn_empty_forwards()

    def on_train_end(self, args, state, control, **kwargs):
        self.on_log(args, state, control)
        self.write()
