"""A test-only Axolotl plugin: `fastqwen_moe_cuda_graphs` captures on the CPU, its two graphs stood in by
eager calls (tests/eager_graph.py), so a real `axolotl train` run on a CPU goes through the capture and
replay protocol (the Trainer's micro-batches, its eval, its optimizer) as it does on a GPU.

Named in a test YAML (with tests/ on PYTHONPATH) beside the plugin's own line."""

from __future__ import annotations

from axolotl.integrations.base import BasePlugin
from eager_graph import install_on_cpu

from axolotl_fastqwen.patching import moe_cuda_graphs

moe_cuda_graphs.MoeCudaGraphs.install = install_on_cpu()


class MoeGraphsOnCpu(BasePlugin):
    """Loads this module (and with it the switch above) in Axolotl's process."""
