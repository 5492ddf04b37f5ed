"""The bench's QLoRA base (`--qlora`): the random bf16 model quantized as Axolotl loads a QLoRA MoE example
(`load_in_4bit: true`, `quantize_moe_experts: true`, e.g. its `examples/qwen3.5/35b-a3b-moe-qlora.yaml`).

Axolotl loads such a checkpoint through transformers' bitsandbytes quantizer: every linear layer of the
decoder becomes a `bitsandbytes.nn.Linear4bit` (nf4, double quantization, bf16 compute; the output head
stays, as transformers skips it), and its loading patch quantizes each routed-expert stack with
bitsandbytes' `replace_parameter_4bit` as it arrives on the GPU (`axolotl.monkeypatch.moe_quant`). The
bench has random weights, not a checkpoint, so it makes the same two calls on the built model, before
peft adds the adapters: every path of the run then trains the same 4-bit base (peft's `Linear4bit` LoRA,
Axolotl's QLoRA LoRA kernels and ScatterMoE's 4-bit experts on `axolotl-best`, the plugin's experts on
its paths). Issue 36: Axolotl's `quantize_moe_experts` + QLoRA example as a path, against the plugin on
the same base.
"""

from __future__ import annotations

import torch
from torch import nn

from axolotl_fastqwen.layers.experts_implementation import EXPERT_WEIGHTS, experts_modules

QUANT_TYPE = "nf4"  # Axolotl's default bnb_4bit_quant_type
DOUBLE_QUANT = True  # Axolotl's default bnb_4bit_use_double_quant


def quantize_base(model: nn.Module, compute_dtype: torch.dtype) -> dict:
    """Quantize `model`'s decoder linears and expert stacks to 4 bits in place (before peft); returns what
    was quantized and the weights' bytes before and after."""
    import bitsandbytes as bnb
    from bitsandbytes.nn.parametrize import replace_parameter_4bit

    before = sum(p.numel() * p.element_size() for p in model.parameters())
    head = model.get_output_embeddings()
    linears = [(name, m) for name, m in model.named_modules() if type(m) is nn.Linear and m is not head]
    for name, linear in linears:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        quantized = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=linear.bias is not None,
                                      compute_dtype=compute_dtype, compress_statistics=DOUBLE_QUANT,
                                      quant_type=QUANT_TYPE, device="meta")
        device = linear.weight.device
        quantized.weight = bnb.nn.Params4bit(linear.weight.data, requires_grad=False, quant_type=QUANT_TYPE,
                                             compress_statistics=DOUBLE_QUANT).to(device)  # quantized on its device
        if linear.bias is not None:
            quantized.bias = nn.Parameter(linear.bias.data, requires_grad=False)
        setattr(parent, child, quantized)
    experts = experts_modules(model)
    for module in experts:
        for name in EXPERT_WEIGHTS:
            replace_parameter_4bit(module, name, compress_statistics=DOUBLE_QUANT, quant_type=QUANT_TYPE)
    if any(p.is_cuda for p in model.parameters()):
        torch.cuda.empty_cache()
    after = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"linears": len(linears), "expert_stacks": len(experts) * len(EXPERT_WEIGHTS), "quant_type": QUANT_TYPE, "double_quant": DOUBLE_QUANT,
            "weights_bytes_before": before, "weights_bytes_after": after}


def is_quantized(model: nn.Module) -> bool:
    """A base quantized by `quantize_base` (or loaded 4-bit by transformers)."""
    try:
        import bitsandbytes as bnb
    except ImportError:
        return False
    return any(isinstance(m, bnb.nn.Linear4bit) for m in model.modules())


def axolotl_keys(model: nn.Module, moe: bool) -> dict:
    """The Axolotl keys that load such a base: `axolotl-best` runs its QLoRA code paths on it."""
    if not is_quantized(model):
        return {}
    return {"adapter": "qlora", "load_in_4bit": True, **({"quantize_moe_experts": True} if moe else {})}
