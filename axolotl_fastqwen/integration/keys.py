"""The plugin's config keys (`fastqwen_*`): their types, defaults and descriptions, merged into
Axolotl's schema through `get_input_args`. What a combination of keys means is decided once, in
`settings.resolve`; a key left unset (None) is the plugin's to decide there.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from ..memory.checkpoint_fitter import DEFAULT_CHECKPOINTING_MEMORY


def _about(text: str) -> dict:
    return {"description": text}


class FastQwenArgs(BaseModel):
    fastqwen_packing: bool | None = Field(default=None, json_schema_extra=_about(
        "Replace Axolotl's collator and sampler with the static-shape 1D packer ([1, fastqwen_token_budget] rows, "
        "exact sequence boundaries). Unset: on, in place of sample_packing / batch_flattening too, except where "
        "it cannot run (streaming or pretraining data, rl, context parallelism, ...: the rows are then Axolotl's, "
        "the fused kernels still run); true insists; false leaves the rows to Axolotl."))
    fastqwen_token_budget: int | None = Field(default=None, json_schema_extra=_about(
        "Tokens per packed micro-batch row, a positive multiple of 64. Default: sequence_len * micro_batch_size, "
        "rounded up to a multiple of 64 (the tokens per step of Axolotl's multipack)."))
    fastqwen_overlong: Literal["error", "truncate", "split"] = Field(default="error", json_schema_extra=_about(
        "What to do with a sample longer than the token budget."))
    fastqwen_kernels: Literal["auto", "require", "reference"] = Field(default="auto", json_schema_extra=_about(
        "auto: fastest self-checked kernels, warn on any PyTorch fallback; require: fail instead of falling back; "
        "reference: PyTorch reference everywhere (debugging)."))
    fastqwen_kernel_preference: dict[str, str] | None = Field(default=None, json_schema_extra=_about(
        "op -> kernel to try first, e.g. {gated_delta_rule: flash-qla} (FlashQLA's TileLang GDN kernels, when "
        "installed). Still self-checked on the GPU; one that fails or cannot run here gives way to the default, "
        "and the load report says why."))
    fastqwen_fused_ce: bool = Field(default=True, json_schema_extra=_about(
        "Compute the loss without materialising the vocabulary logits."))
    fastqwen_checkpointing: Literal["full", "auto"] | None = Field(default=None, json_schema_extra=_about(
        "With gradient_checkpointing: full recomputes every decoder layer (Axolotl's and HF's behaviour); auto "
        "measures the peak memory of the first steps and keeps the activations of as many layers as fit under "
        "fastqwen_checkpointing_memory of the GPU, recomputing the rest. Unset: auto where it can run (one CUDA "
        "device, the plugin's packer, no FSDP / DeepSpeed / torch_compile / activation_offloading), else full; "
        "the load report says why."))
    fastqwen_checkpointing_memory: float = Field(default=DEFAULT_CHECKPOINTING_MEMORY, gt=0.0, lt=1.0,
                                                 json_schema_extra=_about(
        "fastqwen_checkpointing: auto: the fraction of the GPU's memory a step's peak allocation may reach (the "
        "rest is left to the allocator's cache and other processes)."))
    fastqwen_lean_activations: bool | None = Field(default=None, json_schema_extra=_about(
        "In decoder layers whose activations are kept (gradient checkpointing off, or the layers "
        "fastqwen_checkpointing: auto keeps), drop the norm, output-gate and MLP-product outputs autograd would "
        "hold and recompute them in backward: the same gradients bit for bit, less memory per kept layer (at the "
        "27B shape the norms' outputs are a sixth of it, the MLP product another sixth), so auto keeps more "
        "layers. Unset: on unless fsdp, deepspeed or torch_compile is set, or gradient_checkpointing recomputes "
        "every layer (the load report says which); true insists and refuses fsdp, deepspeed and torch_compile; "
        "false turns it off."))
    fastqwen_fused_lora: bool = Field(default=True, json_schema_extra=_about(
        "peft's LoRA linear layers add the adapter's product in its own GEMM (addmm onto the base output), so no "
        "full-size scale or add per adapted projection, forward or backward (the same math; the adapter's product "
        "is rounded once instead of three times). Off under fsdp and deepspeed. Layers that "
        "are not the plain case (DoRA, lora_bias, several active adapters) run peft's own "
        "forward; the load report counts both. false: peft's forward everywhere."))
    fastqwen_moe_cuda_graphs: bool | Literal["auto"] = Field(default="auto", json_schema_extra=_about(
        "MoE models (Qwen3.5-MoE, Qwen3-Next): the sparse MoE block of every decoder layer that keeps its activations "
        "(fastqwen_checkpointing: auto's kept layers, or no gradient checkpointing) replays its forward and backward "
        "as two CUDA graphs once warm: the same kernels, without the host issuing the block's ~100 launches a layer "
        "one by one (the MoE step waits on its host). Layers that gradient checkpointing recomputes, eval, other row "
        "shapes and output_router_logits run the block as before; the load report counts each. auto (default): on "
        "where the plugin packs the rows (one row shape) on one CUDA device, off with a note under torch_compile, "
        "several processes or other rows; true: also there. Off under fsdp and deepspeed."))
    fastqwen_fp8: bool = Field(default=False, json_schema_extra=_about(
        "LoRA on a frozen bf16 base: quantize the decoder's large frozen projections once to FP8 (e4m3, one scale "
        "per output channel; the bf16 copy goes to host memory) and run their forward and input-gradient GEMMs on "
        "FP8 tensor cores, activations and gradients quantized per token. Each weight shape is self-checked and "
        "timed on the GPU at load and stays bf16 where FP8 does not win (the load report lists each). On MoE models "
        "the routed experts' stacks (gate_up_proj, down_proj) go the same way, on FP8 grouped GEMMs, where the "
        "plugin's fastqwen_grouped runs them. Needs a "
        "Hopper GPU (sm_90+), an adapter (lora), one process; refuses load_in_4bit / load_in_8bit, fsdp, "
        "deepspeed and torch_compile. Turns Axolotl's lora_*_kernel off (they read the bf16 weight)."))
    fastqwen_mlp_chunk_tokens: int | None = Field(default=None, gt=0, json_schema_extra=_about(
        "Long rows: a dense model's MLPs run rows of more than this many tokens in chunks of this many, each chunk "
        "recomputed in backward, so that no layer holds the MLP's intermediates (three [tokens, "
        "intermediate_size] tensors: more than half of a kept layer's activations at the 27B shape) and a recomputed "
        "layer never has more than a chunk's alive; the same result, for one more MLP forward in every layer "
        "(0.93x the defaults at 16k-token rows on an H100): a memory lever for rows that do not fit otherwise. "
        "Unset: off. MoE models have no dense MLP (the report says so)."))
    fastqwen_checkpoint_offload: bool | Literal["auto"] = Field(default="auto", json_schema_extra=_about(
        "With gradient_checkpointing: the input each recomputed decoder layer keeps for its recompute (hidden_size "
        "values a token a layer: 20 GiB over the 27B's 64 layers at 32k tokens) goes to pinned host memory while "
        "the layer runs and comes back one layer ahead in backward, both copies beside the compute; the layers "
        "fastqwen_checkpointing: auto keeps are untouched, and auto sizes itself with the offload on. Long rows: "
        "what stops them first is these inputs. auto (default): on from the first training forward whose inputs "
        "would take the GPU past 75% of its memory beside what is allocated, else nothing moves; off where "
        "Axolotl's activation_offloading is set. true: always (refuses Axolotl's activation_offloading: it moves "
        "the same tensors, pick one). false: never."))
    fastqwen_fp8_input_gradient: Literal["fp8", "fp8-1x128", "bf16"] = Field(default="fp8", json_schema_extra=_about(
        "With fastqwen_fp8: how the input gradients dy·W of the FP8 projections run. fp8: on FP8 GEMMs, dy "
        "quantized per token (the fastest); fp8-1x128: dy quantized per 1x128 block (DeepSeek-V3's tiles: an "
        "outlier channel costs only its block; slower GEMMs); bf16: in bf16 on the dequantized weights (FP8 in the "
        "forward only: no rounding of dy, FP8's memory kept, less of its speed). The README's FP8 section has the "
        "measured speed and loss of each. The routed experts' stacks take fp8 under fp8-1x128 (torch has no "
        "block-scaled grouped GEMM)."))
