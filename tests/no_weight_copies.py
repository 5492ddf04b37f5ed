"""A test-only Axolotl plugin: the fused LoRA layers cast their adapters per layer, as before
`patching/lora_weight_copies.py` (the control of a real `axolotl train` run with the copies).

Named in a test YAML (with tests/ on PYTHONPATH) beside the plugin's own line."""

from __future__ import annotations

from axolotl.integrations.base import BasePlugin

from axolotl_fastqwen.patching import lora_weight_copies

lora_weight_copies.LoraWeightCopies._why_not = lambda self, device_type: "off: the test's control"


class NoWeightCopies(BasePlugin):
    """Loads this module (and with it the switch above) in Axolotl's process."""
