"""A test-only Axolotl plugin: `quantize_moe_experts` on a CPU. On a GPU, Axolotl's loader quantizes each
routed-expert stack with bitsandbytes' `replace_parameter_4bit` as it loads it onto the device
(`axolotl.monkeypatch.moe_quant`), and refuses to start without CUDA. This plugin makes the same call, with
the same arguments, on every expert stack once the model is built (before the adapters, as on a GPU), so
that an example trains here on 4-bit experts as it would there. Use it with `quantize_moe_experts: false`."""

from __future__ import annotations

from axolotl.integrations.base import BasePlugin

from axolotl_fastqwen.layers.experts_implementation import EXPERT_WEIGHTS, experts_modules


class QuantizedExpertsOnCpu(BasePlugin):
    def post_model_build(self, cfg, model):
        from bitsandbytes.nn.parametrize import replace_parameter_4bit

        quant_type = cfg.bnb_4bit_quant_type or "nf4"
        double = (cfg.bnb_config_kwargs or {}).get("bnb_4bit_use_double_quant", True)
        for module in experts_modules(model):
            for name in EXPERT_WEIGHTS:
                replace_parameter_4bit(module, name, compress_statistics=double, quant_type=quant_type)
