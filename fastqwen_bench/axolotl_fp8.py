"""Axolotl's own `fp8: true`, as its Trainer applies it: torchao's Float8Linear through Accelerate.

Axolotl 0.21 turns `fp8: true` into `AORecipeKwargs(config=build_fp8_linear_config(recipe))`
(`axolotl/core/trainers/base.py`, `axolotl/core/fp8.py`; recipe `tensorwise` unless `fp8_config`
says otherwise), and Accelerate's `prepare` then calls `convert_model_to_fp8_ao(model, config)`
on the peft model: every `nn.Linear` with both dimensions multiples of 16, except the first and the
last (lm_head), becomes a `Float8Linear`, LoRA's A and B included. Done here by those same functions
on the bench's model, after Axolotl's own patches (the Trainer builds the Accelerator after the
model is loaded and patched); every swapped module is put back on exit (the same Parameter objects:
`Float8Linear.from_float` shares them, so the optimizer is unchanged).
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator

import torch
from torch import nn

from fastqwen_bench.common import PathSkipped

RECIPE = "tensorwise"  # Axolotl 0.21's DEFAULT_FP8_RECIPE


def fp8_config(recipe: str = RECIPE):
    """Axolotl's `build_fp8_linear_config` where Axolotl imports, else the same torchao call it makes."""
    try:
        from axolotl.core.fp8 import build_fp8_linear_config

        return build_fp8_linear_config(fp8_recipe=recipe), "axolotl.core.fp8.build_fp8_linear_config"
    except ImportError:
        from torchao.float8 import Float8LinearConfig

        return Float8LinearConfig.from_recipe_name(recipe), "torchao Float8LinearConfig.from_recipe_name"


@contextlib.contextmanager
def axolotl_fp8(model: nn.Module, device: torch.device) -> Iterator[dict]:
    """Convert `model`'s linear layers as Axolotl's `fp8: true` does; yields the record's info."""
    if importlib.util.find_spec("torchao") is None:
        raise PathSkipped("torchao is not installed (Axolotl's fp8: true needs it)")
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        raise PathSkipped(f"{torch.cuda.get_device_name(device)}: no FP8 tensor cores (Axolotl refuses fp8: true)")
    from accelerate.utils.ao import convert_model_to_fp8_ao
    from torchao.float8.float8_linear import Float8Linear

    config, built_by = fp8_config()
    originals = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
                 if isinstance(child, nn.Linear)]
    try:
        convert_model_to_fp8_ao(model, config=config)
        converted = [(parent, name) for parent, name, _ in originals if isinstance(getattr(parent, name), Float8Linear)]
        lora = sum(1 for parent, _ in converted if isinstance(parent, nn.ModuleDict))  # peft's lora_A / lora_B
        yield {"recipe": RECIPE, "config": built_by, "converted": len(converted), "linear_layers": len(originals),
               "lora_matrices_converted": lora,
               "note": f"Axolotl fp8: true ({RECIPE}, torchao Float8Linear via accelerate's convert_model_to_fp8_ao, "
                       f"eager): {len(converted)} of {len(originals)} nn.Linear converted (LoRA's A/B "
                       f"included: {lora}); the first and the last (lm_head) kept"}
    finally:
        for parent, name, child in originals:
            if getattr(parent, name) is not child:
                setattr(parent, name, child)
