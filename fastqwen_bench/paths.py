"""The training paths the benchmark compares, each a (batch layout, kernel set-up) pair.

Set-ups are context managers around the same model instance and are fully undone on exit:
stock-torch swaps transformers' kernel globals back to its PyTorch fallbacks (the MoE variants
also set transformers' experts implementation), Axolotl's patches are class-level and their
classes, module globals, registries and per-instance attributes are restored (`restore.Undo`),
fastqwen is `patch_model` / `unpatch_model`. Axolotl's paths run last anyway, so a restore bug
could not leak into another path; tests check the restore all the same.

`axolotl-best` (`axolotl_best.py`) is the reference of every speed claim: Axolotl 0.21 configured
for speed (its packing patch, LoRA kernels, fused attention, Liger; ScatterMoE on MoE models);
`axolotl-best-cce` is the same with cut-cross-entropy as the loss.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from axolotl_fastqwen import patch_model, unpatch_model
from axolotl_fastqwen.families.base import unwrap
from axolotl_fastqwen.layers.experts_implementation import experts_modules
from axolotl_fastqwen.layers.grouped_experts import ROUTED_KERNELS_ATTR
from axolotl_fastqwen.layers.moe_block import OWN_FORWARD_ATTR
from axolotl_fastqwen.ops import linear_cross_entropy
from axolotl_fastqwen import registry
from axolotl_fastqwen.transformers_functions import resolved_kernel, stock_torch_kernels
from fastqwen_bench import cpu_fla
from fastqwen_bench.common import PathSkipped
from fastqwen_bench.axolotl_best import axolotl_best
from fastqwen_bench.axolotl_fp8 import axolotl_fp8
from fastqwen_bench.axolotl_import import import_axolotl_patch
from fastqwen_bench.restore import Undo, changed_in_module


@dataclass(frozen=True)
class PathSpec:
    name: str
    layout: str  # a data.LAYOUTS entry
    summary: str


PATHS: dict[str, PathSpec] = {
    p.name: p
    for p in (
        PathSpec("stock-torch-padded", "padded", "stock transformers on its PyTorch fallback kernels, padded batches"),
        PathSpec("stock-fla-padded", "padded", "stock transformers with the kernels it resolved (fla), padded batches"),
        PathSpec(
            "stock-fla-flattening", "flattening",
            "stock transformers + HF DataCollatorWithFlattening (cu_seq_lens, seq_idx), same rows as the packer",
        ),
        PathSpec(
            "axolotl-packing", "multipack",
            "Axolotl 0.21's Qwen3.5 packing patch + multipack rows (position_ids restart, no start masking)",
        ),
        PathSpec("fastqwen", "packed", "patch_model(model) + PackedBatchSampler / PackedCollator static rows"),
        PathSpec(
            "fastqwen-lora-kernels", "packed",
            "fastqwen with Axolotl's fused LoRA kernels composed (lora_qkv_kernel, lora_o_kernel, lora_mlp_kernel: "
            "the plugin's layers call them), as the plugin line added to axolotl-best's YAML gives",
        ),
        PathSpec(
            "axolotl-best", "multipack",
            "Axolotl 0.21 set for speed: packing patch + multipack rows, LoRA kernels, fused attention, sdpa_varlen, "
            "Liger norms/GLU/fused linear CE (MoE: + ScatterMoE), by Axolotl's own functions",
        ),
        PathSpec("axolotl-best-cce", "multipack", "axolotl-best with cut_cross_entropy instead of Liger's fused linear CE"),
        PathSpec(
            "axolotl-best+fp8", "multipack",
            "axolotl-best with Axolotl's `fp8: true` (torchao Float8Linear, tensorwise, through accelerate's "
            "convert_model_to_fp8_ao as Axolotl's Trainer applies it; eager, torch_compile off as in axolotl-best). "
            "Axolotl's lora_*_kernel read base_layer.weight themselves, so no Float8Linear forward runs (H100: the "
            "kernels and the loss of axolotl-best to the unit); see axolotl-best+fp8-no-lora-kernels",
        ),
        PathSpec(
            "axolotl-best+offload", "multipack",
            "axolotl-best with Axolotl's `activation_offloading: hidden_states` (its offloader of checkpointed layers' "
            "inputs, around forward and backward as its Trainer's training_step sets it; needs --gc)",
        ),
        PathSpec(
            "axolotl-best+fp8-no-lora-kernels", "multipack",
            "axolotl-best+fp8 with lora_mlp_kernel, lora_qkv_kernel and lora_o_kernel off, so that torchao's "
            "Float8Linear runs every projection: Axolotl's FP8 as a user gets it",
        ),
        PathSpec(
            "axolotl-best+fastqwen", "packed",
            "axolotl-best's set-up with the plugin line added: Axolotl's kernels stay where they compose (LoRA kernels, "
            "Liger norms/GLU, ScatterMoE), the plugin's layers, loss and packer replace the rest",
        ),
        PathSpec(
            "fastqwen+ckpt-auto", "packed",
            "fastqwen with fastqwen_checkpointing: auto (activations kept for as many layers as fit, the rest "
            "recomputed; needs --gc)",
        ),
        PathSpec(
            "fastqwen+ckpt-auto+torch-norms", "packed",
            "fastqwen+ckpt-auto with its RMSNorms on transformers' own math (fastqwen_kernel_preference: "
            "{rms_norm: torch}): what the rms_norm op's Liger kernel changes",
        ),
        PathSpec(
            "axolotl-best+fastqwen+ckpt-auto", "packed",
            "axolotl-best+fastqwen with fastqwen_checkpointing: auto (needs --gc)",
        ),
        PathSpec(
            "axolotl-best+fastqwen+ckpt-auto+flash-qla", "packed",
            "axolotl-best+fastqwen+ckpt-auto with FlashQLA's TileLang GDN kernels "
            "(fastqwen_kernel_preference: {gated_delta_rule: flash-qla}; gate and beta computed outside)",
        ),
        PathSpec(
            "axolotl-best+fastqwen+ckpt-auto+lean", "packed",
            "axolotl-best+fastqwen+ckpt-auto with fastqwen_lean_activations (norm outputs of kept layers "
            "recomputed in backward, not held)",
        ),
        PathSpec(
            "axolotl-best+fastqwen+ckpt-auto+flash-qla+lean", "packed",
            "axolotl-best+fastqwen+ckpt-auto+flash-qla with fastqwen_lean_activations",
        ),
        PathSpec(
            "fastqwen+ckpt-auto+lean", "packed",
            "fastqwen+ckpt-auto with fastqwen_lean_activations: what the plugin line alone gives (its defaults) "
            "with gradient checkpointing on (MoE: with fastqwen_moe_cuda_graphs: auto, the line's default)",
        ),
        PathSpec(
            "fastqwen+ckpt-auto+lean+peft-lora", "packed",
            "fastqwen+ckpt-auto+lean with fastqwen_fused_lora: false: peft's own LoRA forward (a full-size scale "
            "and add per adapted projection, autograd's sum of both input gradients): what the fused LoRA changes",
        ),
        PathSpec(
            "fastqwen+ckpt-auto+lean+stock-mlp", "packed",
            "fastqwen+ckpt-auto+lean with the dense MLPs (MoE: the shared experts) stock (patch_model(swiglu_mlps="
            "False)): SiLU and the multiply as two kernels, gate, silu(gate), up and the product held: what the "
            "swiglu op (layers/mlp.py) changes",
        ),
        PathSpec(
            "fastqwen+ckpt-auto+lean+liger-chunks", "packed",
            "fastqwen+ckpt-auto+lean with the loss on Liger's own chunk sizes (chunk_mem_const 1: 128 tokens at "
            "hidden 2048, 256 at 5120) instead of LIGER_MIN_CHUNK_TOKENS: what the loss's larger chunks change",
        ),
        PathSpec(
            "fastqwen+ckpt-auto+lean+triton-loss", "packed",
            "fastqwen+ckpt-auto+lean with the loss on the plugin's own Triton rows kernel (fastqwen_kernel_preference: "
            "{linear_cross_entropy: triton}; ops/cross_entropy_rows.py): Liger's chunked loss without its three host "
            "syncs a step",
        ),
        PathSpec(
            "fastqwen+ckpt-auto+lean+moe-graphs", "packed",
            "MoE only: fastqwen+ckpt-auto+lean with fastqwen_moe_cuda_graphs: true (the kept layers' sparse MoE "
            "blocks replay their forward and backward as CUDA graphs once warm, patching/moe_cuda_graphs.py); on "
            "one GPU with the packer's rows, what the line's default (auto) does too",
        ),
        PathSpec(
            "fastqwen+ckpt-auto+lean+no-moe-graphs", "packed",
            "MoE only: fastqwen+ckpt-auto+lean with fastqwen_moe_cuda_graphs: false (every sparse MoE block eager, "
            "the line's defaults before the graphs were on): what the graphs change",
        ),
        PathSpec(
            "fastqwen+ckpt-auto+lean+torch-rows", "packed",
            "MoE only: fastqwen+ckpt-auto+lean with the routed experts' row work on PyTorch's ops (the module's own "
            "_apply_gate, a multiply, a gather and a sum, as before ops/routed_swiglu.py and ops/routed_combine.py) "
            "and the sparse block's shared expert added by transformers' own forward (not in the routed sum, "
            "layers/moe_block.py): what the Triton row kernels change",
        ),
        PathSpec(
            "fastqwen+ckpt-auto+lean+fp8", "packed",
            "fastqwen+ckpt-auto+lean with fastqwen_fp8: the frozen projections on FP8 GEMMs (quantized once, "
            "each shape self-checked and timed at load)",
        ),
        PathSpec(
            "fastqwen+ckpt-auto+lean+mlp-chunks", "packed",
            "fastqwen+ckpt-auto+lean with fastqwen_mlp_chunk_tokens: 8192 (rows longer than that run each dense MLP in "
            "8,192-token chunks, each recomputed in backward; long rows only)",
        ),
        PathSpec(
            "fastqwen+ckpt-auto+lean+offload", "packed",
            "fastqwen+ckpt-auto+lean with fastqwen_checkpoint_offload (recomputed layers' inputs in pinned host "
            "memory, prefetched one layer ahead in backward)",
        ),
        PathSpec(
            "fastqwen+ckpt-auto+lean+fp8+offload", "packed",
            "fastqwen+ckpt-auto+lean with fastqwen_fp8 and fastqwen_checkpoint_offload: FP8's freed weight memory "
            "and the offloaded inputs both go to kept layers (long rows, without the MLP chunks' third forward)",
        ),
        PathSpec(
            "fastqwen+ckpt-auto+lean+fp8+offload+chunks", "packed",
            "the plugin's least memory a token: fastqwen_fp8, fastqwen_checkpoint_offload and "
            "fastqwen_mlp_chunk_tokens: 8192 with auto and lean (long rows)",
        ),
        PathSpec(
            "fastqwen+ckpt-auto+lean+fp8-forward", "packed",
            "fastqwen+ckpt-auto+lean+fp8 with the input gradient in bf16 on the dequantized weights "
            "(patch_model(fp8_input_gradient='bf16')): FP8's forward GEMMs and its memory, no quantized dy",
        ),
        PathSpec(
            "stock-moe-eager", "padded",
            "MoE only: stock transformers, PyTorch fallback kernels, experts_implementation eager, padded batches",
        ),
        PathSpec(
            "stock-moe-grouped-mm", "padded",
            "MoE only: stock transformers, PyTorch fallback kernels, experts_implementation grouped_mm, padded batches",
        ),
    )
}
# `--paths` letters: a-e as before, then the new paths
LETTERS = {
    "a": "stock-torch-padded", "b": "stock-fla-padded", "c": "stock-fla-flattening", "d": "axolotl-packing",
    "e": "fastqwen", "f": "axolotl-best", "g": "axolotl-best-cce", "h": "stock-moe-eager", "i": "stock-moe-grouped-mm",
    "j": "fastqwen-lora-kernels", "k": "axolotl-best+fastqwen", "l": "axolotl-best+fastqwen+ckpt-auto",
    "m": "fastqwen+ckpt-auto", "n": "axolotl-best+fastqwen+ckpt-auto+flash-qla",
    "o": "axolotl-best+fastqwen+ckpt-auto+lean", "p": "axolotl-best+fastqwen+ckpt-auto+flash-qla+lean",
    "q": "fastqwen+ckpt-auto+torch-norms", "r": "fastqwen+ckpt-auto+lean+fp8", "s": "fastqwen+ckpt-auto+lean",
    "t": "axolotl-best+fp8", "u": "fastqwen+ckpt-auto+lean+fp8-forward",
    "v": "axolotl-best+fp8-no-lora-kernels", "w": "fastqwen+ckpt-auto+lean+mlp-chunks",
    "x": "fastqwen+ckpt-auto+lean+offload", "y": "axolotl-best+offload",
    "z": "fastqwen+ckpt-auto+lean+fp8+offload+chunks", "A": "fastqwen+ckpt-auto+lean+fp8+offload",
    "B": "fastqwen+ckpt-auto+lean+peft-lora", "C": "fastqwen+ckpt-auto+lean+torch-rows",
    "D": "fastqwen+ckpt-auto+lean+stock-mlp", "E": "fastqwen+ckpt-auto+lean+liger-chunks",
    "F": "fastqwen+ckpt-auto+lean+triton-loss", "G": "fastqwen+ckpt-auto+lean+moe-graphs",
    "H": "fastqwen+ckpt-auto+lean+no-moe-graphs",
}
# Axolotl's patches are class-level: run them last.
EXECUTION_ORDER = (
    "stock-torch-padded", "stock-moe-eager", "stock-moe-grouped-mm", "stock-fla-padded", "stock-fla-flattening",
    "fastqwen", "fastqwen-lora-kernels", "fastqwen+ckpt-auto", "fastqwen+ckpt-auto+torch-norms",
    "fastqwen+ckpt-auto+lean+peft-lora", "fastqwen+ckpt-auto+lean+torch-rows", "fastqwen+ckpt-auto+lean+stock-mlp",
    "fastqwen+ckpt-auto+lean+liger-chunks", "fastqwen+ckpt-auto+lean+triton-loss", "fastqwen+ckpt-auto+lean+moe-graphs",
    "fastqwen+ckpt-auto+lean+no-moe-graphs", "fastqwen+ckpt-auto+lean", "fastqwen+ckpt-auto+lean+fp8",
    "fastqwen+ckpt-auto+lean+fp8-forward", "fastqwen+ckpt-auto+lean+mlp-chunks", "fastqwen+ckpt-auto+lean+offload", "fastqwen+ckpt-auto+lean+fp8+offload",
    "fastqwen+ckpt-auto+lean+fp8+offload+chunks", "axolotl-packing",
    "axolotl-best", "axolotl-best-cce", "axolotl-best+offload", "axolotl-best+fp8", "axolotl-best+fp8-no-lora-kernels",
    "axolotl-best+fastqwen", "axolotl-best+fastqwen+ckpt-auto", "axolotl-best+fastqwen+ckpt-auto+flash-qla",
    "axolotl-best+fastqwen+ckpt-auto+lean", "axolotl-best+fastqwen+ckpt-auto+flash-qla+lean",
)
# every speed claim is a ratio to the faster of these (same run, model and stream)
REFERENCE_PATHS = ("axolotl-best", "axolotl-best-cce")
EXPERTS_PATHS = {"stock-moe-eager": "eager", "stock-moe-grouped-mm": "grouped_mm"}
# path -> the path it repeats with fastqwen_checkpointing: auto (the bench's loop drives the fitter)
CHECKPOINTING_AUTO = {"fastqwen+ckpt-auto": "fastqwen", "fastqwen+ckpt-auto+torch-norms": "fastqwen",
                      "fastqwen+ckpt-auto+lean": "fastqwen", "fastqwen+ckpt-auto+lean+fp8": "fastqwen",
                      "fastqwen+ckpt-auto+lean+peft-lora": "fastqwen",
                      "fastqwen+ckpt-auto+lean+torch-rows": "fastqwen",
                      "fastqwen+ckpt-auto+lean+stock-mlp": "fastqwen",
                      "fastqwen+ckpt-auto+lean+liger-chunks": "fastqwen",
                      "fastqwen+ckpt-auto+lean+triton-loss": "fastqwen",
                      "fastqwen+ckpt-auto+lean+moe-graphs": "fastqwen",
                      "fastqwen+ckpt-auto+lean+no-moe-graphs": "fastqwen",
                      "fastqwen+ckpt-auto+lean+fp8-forward": "fastqwen",
                      "fastqwen+ckpt-auto+lean+mlp-chunks": "fastqwen",
                      "fastqwen+ckpt-auto+lean+offload": "fastqwen",
                      "fastqwen+ckpt-auto+lean+fp8+offload": "fastqwen",
                      "fastqwen+ckpt-auto+lean+fp8+offload+chunks": "fastqwen",
                      "axolotl-best+fastqwen+ckpt-auto": "axolotl-best+fastqwen",
                      "axolotl-best+fastqwen+ckpt-auto+flash-qla": "axolotl-best+fastqwen",
                      "axolotl-best+fastqwen+ckpt-auto+lean": "axolotl-best+fastqwen",
                      "axolotl-best+fastqwen+ckpt-auto+flash-qla+lean": "axolotl-best+fastqwen"}
# path -> the plugin's kernel preference (patch_model(prefer=...)); the path is skipped when it does not take
KERNEL_PREFERENCE = {"axolotl-best+fastqwen+ckpt-auto+flash-qla": {"gated_delta_rule": "flash-qla"},
                     "fastqwen+ckpt-auto+torch-norms": {"rms_norm": "torch"},
                     "fastqwen+ckpt-auto+lean+triton-loss": {"linear_cross_entropy": "triton"},
                     "axolotl-best+fastqwen+ckpt-auto+flash-qla+lean": {"gated_delta_rule": "flash-qla"}}
# paths with fastqwen_lean_activations (patch_model(lean_activations=True))
LEAN_ACTIVATIONS = ("axolotl-best+fastqwen+ckpt-auto+lean", "axolotl-best+fastqwen+ckpt-auto+flash-qla+lean",
                    "fastqwen+ckpt-auto+lean", "fastqwen+ckpt-auto+lean+fp8", "fastqwen+ckpt-auto+lean+fp8-forward",
                    "fastqwen+ckpt-auto+lean+peft-lora", "fastqwen+ckpt-auto+lean+torch-rows",
                    "fastqwen+ckpt-auto+lean+stock-mlp", "fastqwen+ckpt-auto+lean+liger-chunks",
                    "fastqwen+ckpt-auto+lean+triton-loss", "fastqwen+ckpt-auto+lean+moe-graphs",
                    "fastqwen+ckpt-auto+lean+no-moe-graphs",
                    "fastqwen+ckpt-auto+lean+mlp-chunks", "fastqwen+ckpt-auto+lean+offload",
                    "fastqwen+ckpt-auto+lean+fp8+offload", "fastqwen+ckpt-auto+lean+fp8+offload+chunks")
# paths with fastqwen_fp8 (patch_model(fp8=True, fp8_tokens=the row's budget))
FP8 = ("fastqwen+ckpt-auto+lean+fp8", "fastqwen+ckpt-auto+lean+fp8-forward",
       "fastqwen+ckpt-auto+lean+fp8+offload", "fastqwen+ckpt-auto+lean+fp8+offload+chunks")
# paths with fastqwen_mlp_chunk_tokens, and its value
MLP_CHUNKS = {"fastqwen+ckpt-auto+lean+mlp-chunks": 8192, "fastqwen+ckpt-auto+lean+fp8+offload+chunks": 8192}
# paths with fastqwen_checkpoint_offload (patch_model(checkpoint_offload=True))
CHECKPOINT_OFFLOAD = ("fastqwen+ckpt-auto+lean+offload", "fastqwen+ckpt-auto+lean+fp8+offload",
                      "fastqwen+ckpt-auto+lean+fp8+offload+chunks")
# paths on peft's own LoRA forward (patch_model(fused_lora=False))
PEFT_LORA = ("fastqwen+ckpt-auto+lean+peft-lora",)
# paths whose dense MLPs stay stock (patch_model(swiglu_mlps=False))
STOCK_MLP = ("fastqwen+ckpt-auto+lean+stock-mlp",)
# paths whose loss runs on Liger's own chunk sizes (linear_cross_entropy.LIGER_MIN_CHUNK_TOKENS set to 1)
LIGER_OWN_CHUNKS = ("fastqwen+ckpt-auto+lean+liger-chunks",)
# MoE paths whose kept layers' sparse blocks replay as CUDA graphs (patch_model(moe_cuda_graphs=True))
MOE_CUDA_GRAPHS = ("fastqwen+ckpt-auto+lean+moe-graphs",)
# MoE paths without them (patch_model(moe_cuda_graphs=False)); the other lean paths take the line's default, auto
NO_MOE_CUDA_GRAPHS = ("fastqwen+ckpt-auto+lean+no-moe-graphs",)
# MoE paths whose routed experts run their row work on PyTorch's ops (not ops/routed_swiglu.py, ops/routed_combine.py)
TORCH_ROWS = ("fastqwen+ckpt-auto+lean+torch-rows",)
# FP8 paths whose input gradient `dy·W` runs in bf16 (patch_model(fp8_input_gradient="bf16"))
FP8_BF16_INPUT_GRADIENT = ("fastqwen+ckpt-auto+lean+fp8-forward",)
# paths whose GEMMs round to FP8 by design: their calibration loss is reported, not held to the
# exact paths' agreement tolerance
QUANTIZED = (*FP8, "axolotl-best+fp8", "axolotl-best+fp8-no-lora-kernels")
# Axolotl's LoRA kernels: torchao's Float8Linear runs only where they are off
NO_LORA_KERNELS = {"lora_mlp_kernel": False, "lora_qkv_kernel": False, "lora_o_kernel": False}

STOCK_GLOBALS = ("torch_chunk_gated_delta_rule", "causal_conv1d_fn")




def parse_paths(text: str | None) -> list[str]:
    """`--paths a,f` (names or their letters, see LETTERS) -> names in execution order."""
    if not text or text == "all":
        return list(EXECUTION_ORDER)
    wanted = []
    for item in (t.strip() for t in text.split(",") if t.strip()):
        name = LETTERS.get(item, item)
        if name not in PATHS:
            known = ", ".join(f"{k}={v}" for k, v in LETTERS.items())
            raise ValueError(f"unknown path {item!r}; known: {known}")
        wanted.append(name)
    return [p for p in EXECUTION_ORDER if p in wanted]


def stock_kernels(family: str, device_type: str | None = None) -> dict[str, str]:
    """What each stock kernel global resolved to at import; with `device_type`, what runs there."""
    return {name: resolved_kernel(family, name, device_type) for name in STOCK_GLOBALS}


@contextlib.contextmanager
def installed(name: str, model: torch.nn.Module, family: str, device: torch.device,
              dtype: torch.dtype = torch.float32, gc: bool = False, budget: int = 8192) -> Iterator[dict]:
    """Set the model up for path `name`; yields an info dict the path's record keeps."""
    info: dict = {"notes": []}
    prefer = KERNEL_PREFERENCE.get(name)
    lean = name in LEAN_ACTIVATIONS
    fp8 = budget if name in FP8 else None
    input_gradient = "bf16" if name in FP8_BF16_INPUT_GRADIENT else "fp8"
    mlp_chunk_tokens = MLP_CHUNKS.get(name)
    fused_lora = name not in PEFT_LORA
    torch_rows = name in TORCH_ROWS
    swiglu_mlps = name not in STOCK_MLP
    moe_graphs = True if name in MOE_CUDA_GRAPHS else False if name in NO_MOE_CUDA_GRAPHS else \
        "auto" if name in LEAN_ACTIVATIONS else False
    liger_min_chunk = 1 if name in LIGER_OWN_CHUNKS else linear_cross_entropy.LIGER_MIN_CHUNK_TOKENS
    if (torch_rows or name in MOE_CUDA_GRAPHS + NO_MOE_CUDA_GRAPHS) and not registry.family(family).moe:
        raise PathSkipped(f"{family} is a dense model: no routed experts")
    # the plugin line's default is `auto` (on where the checkpointed inputs would crowd the device): the lean
    # paths are the line's defaults plus what each names
    offload = True if name in CHECKPOINT_OFFLOAD else "auto" if name in LEAN_ACTIVATIONS else False
    if name in CHECKPOINTING_AUTO:
        if not gc:
            raise PathSkipped("fastqwen_checkpointing: auto chooses which layers recompute: run with --gc")
        name = CHECKPOINTING_AUTO[name]
    if name in EXPERTS_PATHS:
        if not registry.family(family).moe:
            raise PathSkipped(f"{family} is a dense model: no experts")
        with stock_torch_kernels(family), experts_implementation(model, EXPERTS_PATHS[name]) as how:
            info["stock_kernels"] = stock_kernels(family)
            info["notes"].append(f"experts_implementation {EXPERTS_PATHS[name]!r} ({how})")
            yield info
        return
    if name in ("axolotl-best+fp8", "axolotl-best+fp8-no-lora-kernels"):
        overrides = NO_LORA_KERNELS if name == "axolotl-best+fp8-no-lora-kernels" else None
        with axolotl_best(model, family, device, dtype, loss="liger", gc=gc, overrides=overrides) as best, \
                axolotl_fp8(model, device) as fp8:
            info["notes"] += best["notes"] + [fp8["note"], fla_gdn_dispatch()]
            info["axolotl_components"] = best["components"]
            info["axolotl_config"] = {**best["axolotl_config"], "fp8": True}
            info["axolotl_fp8"] = fp8
            yield info
        return
    if name == "axolotl-best+offload":
        if not gc:
            raise PathSkipped("activation_offloading: hidden_states offloads checkpointed layers' inputs: run with --gc")
        with axolotl_best(model, family, device, dtype, loss="liger", gc=gc) as best, \
                axolotl_hidden_states_offload() as offloader:
            info["notes"] += best["notes"] + [fla_gdn_dispatch()]
            info["axolotl_components"] = best["components"]
            info["axolotl_config"] = {**best["axolotl_config"], "activation_offloading": "hidden_states"}
            info["step_context"] = lambda: offloader
            info["stats"] = lambda: {"axolotl_offload": vars(offloader.stats)}
            yield info
        return
    if name in REFERENCE_PATHS:
        loss = "cce" if name == "axolotl-best-cce" else "liger"
        with axolotl_best(model, family, device, dtype, loss=loss, gc=gc) as best:
            cce = next((c for c in best["components"] if c["key"] == "cut_cross_entropy"), None)
            if device.type == "cuda" and cce is not None and cce["status"] != "applied":
                raise PathSkipped(f"cut_cross_entropy did not apply, so this variant would repeat axolotl-best "
                                  f"without its loss: {cce['reason'][:400]}")
            info["notes"] += best["notes"]
            info["notes"].append(fla_gdn_dispatch())
            info["axolotl_components"] = best["components"]
            info["axolotl_config"] = best["axolotl_config"]
            yield info
        return
    if name == "stock-torch-padded":
        with stock_torch_kernels(family):
            info["stock_kernels"] = stock_kernels(family)
            yield info
        return
    if name in ("stock-fla-padded", "stock-fla-flattening"):
        info["stock_kernels"] = kernels = stock_kernels(family)
        running = stock_kernels(family, device.type)
        if device.type != "cuda" and any(v != "torch" for v in running.values()):
            info["notes"].append(
                f"transformers resolved {kernels} at import; these are CUDA/Triton kernels and this device is "
                f"{device.type}: the stock forward is expected to crash here"
            )
        elif running != kernels:
            info["notes"].append(
                f"transformers resolved {kernels} at import and sends inputs on {device.type} to its PyTorch "
                f"functions itself (transformers 5.25+): this path runs {running}"
            )
        if all(v == "torch" for v in kernels.values()):
            info["notes"].append("no fla / causal-conv1d resolved: this path runs the PyTorch fallback")
        if name == "stock-fla-flattening" and kernels.get("causal_conv1d_fn") != "causal_conv1d":
            info["notes"].append(
                "causal_conv1d_fn is not causal-conv1d: the stock torch conv cannot use seq_idx (transformers "
                "5.17 lets its taps read across packed-sequence boundaries: expect a small calibration-loss "
                "difference; 5.20+ raises instead)"
            )
        yield info
        return
    if name == "axolotl-packing":
        with axolotl_patch(family, device) as notes:
            info["notes"] += notes
            yield info
        return
    if name in ("fastqwen", "fastqwen-lora-kernels"):
        undo = Undo()
        if name == "fastqwen-lora-kernels":
            info["notes"].append(_attach_axolotl_lora_kernels(model, device, undo))
        undo.attr(linear_cross_entropy, "LIGER_MIN_CHUNK_TOKENS")
        linear_cross_entropy.LIGER_MIN_CHUNK_TOKENS = liger_min_chunk
        try:
            with _plugin(model, device, info, prefer, lean, fp8, input_gradient, mlp_chunk_tokens, offload, fused_lora,
                         torch_rows, swiglu_mlps, moe_graphs):
                yield info
        finally:
            undo.restore()
        return
    if name == "axolotl-best+fastqwen":
        with axolotl_best(model, family, device, dtype, loss="liger", gc=gc) as best, \
                _plugin(model, device, info, prefer, lean):
            info["notes"] += best["notes"]
            info["axolotl_components"] = best["components"]
            info["axolotl_config"] = best["axolotl_config"]
            yield info
        return
    raise ValueError(f"unknown path {name!r}")


@contextlib.contextmanager
def axolotl_hidden_states_offload() -> Iterator[object]:
    """Axolotl's `activation_offloading: hidden_states` context, as its Trainer builds it for a
    non-reentrant checkpoint (the bench's --gc), to enter around each step's forward and backward.
    Its first entry patches `GradientCheckpointingLayer.__call__` (a marker) for good: undone here."""
    from axolotl.monkeypatch import checkpoint_activation_offload as offload
    from transformers import GradientCheckpointingLayer

    call = GradientCheckpointingLayer.__dict__["__call__"]
    try:
        yield offload.get_checkpoint_hidden_states_offloading_ctx_manager(use_streams=True)
    finally:
        GradientCheckpointingLayer.__call__ = call
        offload._ORIG_GRADIENT_CHECKPOINTING_LAYER_CALL = None


def fla_gdn_dispatch() -> str:
    """Where fla 0.6 sends Axolotl's gated delta rule (gate and beta computed outside, as its packing
    patch calls it): its dispatch takes the first installed and enabled backend whose verifier
    accepts the call, so an installed FlashQLA (FLA_FLASH_QLA not 0) runs Axolotl's GDN too."""
    try:
        from fla.backends import _load_operation_registry  # fla's registry has no public getter

        active = _load_operation_registry("gated_delta_rule").get_active()
    except Exception as exc:  # noqa: BLE001 - fla < 0.6 has no dispatch: its Triton kernels
        return f"fla GDN dispatch: fla's Triton kernels (no backend registry: {type(exc).__name__})"
    name = active.backend_type if active is not None else "none"
    return f"fla GDN dispatch: first enabled backend {name!r} (else fla's Triton kernels)"


@contextlib.contextmanager
def _plugin(model, device: torch.device, info: dict, prefer: dict[str, str] | None = None,
            lean: bool = False, fp8_tokens: int | None = None, fp8_input_gradient: str = "fp8",
            mlp_chunk_tokens: int | None = None, checkpoint_offload: bool | str = False,
            fused_lora: bool = True, torch_rows: bool = False, swiglu_mlps: bool = True,
            moe_graphs: bool | str = False) -> Iterator[None]:
    """`patch_model` for the block (the plugin's post_model_load: after Axolotl's own patches)."""
    if fp8_tokens and not hasattr(model, "peft_config"):
        raise PathSkipped("fastqwen_fp8 quantizes a frozen base: it needs LoRA (this run is a full fine-tune)")
    report = patch_model(model, prefer=prefer, lean_activations=lean, fp8=bool(fp8_tokens),
                         fp8_tokens=fp8_tokens or 8192, fp8_input_gradient=fp8_input_gradient,
                         mlp_chunk_tokens=mlp_chunk_tokens, checkpoint_offload=checkpoint_offload,
                         fused_lora=fused_lora, swiglu_mlps=swiglu_mlps, moe_cuda_graphs=moe_graphs)
    info["patch_report"] = report
    experts = experts_modules(unwrap(model)) if torch_rows else []
    for module in experts:  # pinned as the experts self-check pins it when the kernels fail
        module.__dict__[ROUTED_KERNELS_ATTR] = "torch"
    blocks = [m for m in unwrap(model).modules() if torch_rows and hasattr(m, "shared_expert_gate")]
    for block in blocks:  # and the shared expert's term outside the sum, as transformers' block adds it
        block.__dict__[OWN_FORWARD_ATTR] = True
    try:
        if device.type == "cuda":
            _selfcheck_now(report, model)
        for op, wanted in (prefer or {}).items():
            choice = report.kernels.choices[op]
            if choice.backend.name != wanted:
                why = dict(choice.rejected).get(wanted, "not chosen")
                raise PathSkipped(f"{op}: {wanted} did not take ({why}); this path would repeat its base path")
        print(report.format(), flush=True)
        yield
    finally:
        info["patch_report"] = report.to_dict()  # after the first forward: includes the self-check
        unpatch_model(model)  # takes the pin off too
        for block in blocks:
            block.__dict__.pop(OWN_FORWARD_ATTR, None)


def _attach_axolotl_lora_kernels(model, device: torch.device, undo: Undo) -> str:
    """Axolotl's own `apply_lora_kernel_patches` on the peft model (per-instance, undone after)."""
    if not hasattr(model, "peft_config"):
        raise PathSkipped("Axolotl's LoRA kernels need a LoRA (peft) model: this run is a full fine-tune")
    try:
        lora_kernels, stood_in = import_axolotl_patch("axolotl.monkeypatch.lora_kernels")
        from axolotl.utils.dict import DictDefault
    except Exception as exc:  # a partial Axolotl install
        raise PathSkipped(f"Axolotl's LoRA kernels do not import: {type(exc).__name__}: {str(exc)[:300]}") from None
    mlp = device.type == "cuda"  # its SwiGLU is Triton
    undo.instances(model)
    lora_kernels.apply_lora_kernel_patches(
        model, DictDefault(lora_qkv_kernel=True, lora_o_kernel=True, lora_mlp_kernel=mlp))
    fused = sorted({k for m in unwrap(model).modules() for k in ("apply_in_proj_fused", "apply_out_proj") if k in vars(m)})
    note = (f"Axolotl apply_lora_kernel_patches(lora_qkv_kernel, lora_o_kernel{', lora_mlp_kernel' if mlp else ''}) "
            f"attached; GDN: {', '.join(fused) or 'none'}")
    if not mlp:
        note += "; lora_mlp_kernel left out (Triton SwiGLU, CUDA only)"
    if stood_in:
        note += f"; stood in during Axolotl's import: {'; '.join(stood_in)}"
    return note


def _selfcheck_now(report, model) -> None:
    """Run the plugin's GPU kernel self-check now, before the path's calibration forward, so that
    its kernel runs (and any autotuning they trigger) are not counted in the calibration time."""
    from axolotl_fastqwen.families.base import unwrap
    from axolotl_fastqwen.patching.decoder_hook import check_shapes, kernel_input_dtype
    from axolotl_fastqwen.kernel_choice import selfcheck
    from axolotl_fastqwen.kernel_choice.experts_selfcheck import selfcheck_experts

    base = unwrap(model)
    with torch.enable_grad():
        selfcheck(report.kernels, check_shapes(base))
        report.experts_check = selfcheck_experts(base, kernel_input_dtype(base, report.kernels.device))


@contextlib.contextmanager
def experts_implementation(model: torch.nn.Module, impl: str) -> Iterator[str]:
    """Set transformers' experts implementation of the model for the block; restore it after.

    transformers' `@use_experts_implementation` forward reads `config._experts_implementation` at
    every call. `PreTrainedModel.set_experts_implementation` (what Axolotl's loader calls) checks
    the name and sets it; a transformers without it gets the config field its decorator reads."""
    base = unwrap(model)
    config = base.config
    before = vars(config).get("_experts_implementation_internal")
    if hasattr(base, "set_experts_implementation"):
        base.set_experts_implementation(impl)
        how = f"model.set_experts_implementation({impl!r}); was {before!r}"
    else:
        config._experts_implementation = impl
        how = f"config._experts_implementation = {impl!r}; was {before!r}"
    try:
        yield how
    finally:
        config._experts_implementation_internal = before


@contextlib.contextmanager
def axolotl_patch(family: str, device: torch.device | None = None) -> Iterator[list[str]]:
    """Apply Axolotl's class-level packing patch; restore the modeling module exactly afterwards."""
    if registry.family(family).axolotl is None:
        raise PathSkipped(f"Axolotl has no packing patch for {family}")
    module_name, fn_name = registry.family(family).axolotl.packing
    try:
        patch_module, stood_in = import_axolotl_patch(module_name)
        apply = getattr(patch_module, fn_name)
    except Exception as exc:  # a partial Axolotl install (GPU machine) is expected
        raise PathSkipped(f"import {module_name}.{fn_name} failed: {type(exc).__name__}: {str(exc)[:300]}") from None
    modeling = importlib.import_module(registry.family(family).modeling_module)
    undo = Undo()
    saved = undo.module(modeling)
    try:
        notes = []
        if device is not None and device.type != "cuda":
            note = cpu_fla.install(undo, patch_module, family)
            if note:
                notes.append(note)
        apply()
        changed = changed_in_module(modeling, saved)
        note = f"Axolotl {fn_name}() applied (class-level; changed {', '.join(changed) or 'nothing'}; restored after)"
        if stood_in:
            note += f"; stood in during Axolotl's import (bench/axolotl_import.py): {'; '.join(stood_in)}"
        yield [note, *notes]
    finally:
        undo.restore()

