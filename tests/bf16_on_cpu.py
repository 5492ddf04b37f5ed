"""A test-only Axolotl plugin: `bf16: true` on a CPU. transformers' TrainingArguments refuse bf16
without a GPU unless `use_cpu` is set, which Axolotl's YAML has no key for; this plugin sets it, so
the Trainer runs under bf16 autocast on the CPU as it does on a GPU."""

from __future__ import annotations

from axolotl.integrations.base import BasePlugin


class Bf16OnCpu(BasePlugin):
    def get_training_args(self, cfg):
        return {"use_cpu": True}
