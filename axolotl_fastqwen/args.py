"""The plugin's config keys (`fastqwen_*`), merged into Axolotl's schema through `get_input_args`.

Contradictory settings fail at config load, naming the key and the fix, because each of them
would otherwise train silently wrong or silently slow.
"""

from __future__ import annotations

import difflib
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from .checkpointing import DEFAULT_CHECKPOINTING_MEMORY
from .packing.planner import TOKEN_BUDGET_MULTIPLE as TOKEN_MULTIPLE  # one place: the packer's grid


LEAN_ACTIVATIONS_CLASHES = ("fsdp", "fsdp_config", "deepspeed", "torch_compile")
LEAN_ACTIVATIONS_CLASH_WHY = ("sharded weights are freed after the forward, before its recompute reads them, and a "
                              "compiled forward does not run its hooks")


def lean_activations_clashes(cfg: Any) -> list[str]:
    """The keys set in `cfg` under which `fastqwen_lean_activations` cannot run."""
    return [key for key in LEAN_ACTIVATIONS_CLASHES if cfg.get(key) not in (None, False, "", {}, [])]


def lean_activations_setting(cfg: Any) -> tuple[bool, str | None]:
    """Whether lean activations run, and the report note that says why they do nothing, if so."""
    value = cfg.get("fastqwen_lean_activations")
    clashes = lean_activations_clashes(cfg)
    if value is None and clashes:
        return False, f"lean activations off (default): {', '.join(clashes)} set, and {LEAN_ACTIVATIONS_CLASH_WHY}"
    every_layer_recomputed = cfg.get("gradient_checkpointing") and cfg.get("fastqwen_checkpointing") != "auto"
    if value is None and every_layer_recomputed:
        return False, ("lean activations off (default): gradient_checkpointing recomputes every layer, so none keeps "
                       "activations to drop; fastqwen_checkpointing: auto keeps some and turns them on")
    if value and every_layer_recomputed:
        return True, ("fastqwen_lean_activations drops nothing here: gradient_checkpointing recomputes every layer "
                      "(fastqwen_checkpointing: full); it pays with fastqwen_checkpointing: auto")
    return value is not False, None


class FastQwenArgs(BaseModel):
    fastqwen_packing: bool = Field(
        default=True,
        json_schema_extra={
            "description": "Replace Axolotl's collator and sampler with the static-shape 1D packer "
            "([1, fastqwen_token_budget] rows, exact sequence boundaries)."
        },
    )
    fastqwen_token_budget: int | None = Field(
        default=None,
        json_schema_extra={
            "description": "Tokens per packed micro-batch row, a positive multiple of 64. Default: "
            "sequence_len * micro_batch_size, rounded up to a multiple of 64."
        },
    )
    fastqwen_overlong: Literal["error", "truncate", "split"] = Field(
        default="error",
        json_schema_extra={"description": "What to do with a sample longer than the token budget."},
    )
    fastqwen_kernels: Literal["auto", "require", "reference"] = Field(
        default="auto",
        json_schema_extra={
            "description": "auto: fastest self-checked kernels, warn on any PyTorch fallback; require: "
            "fail instead of falling back; reference: PyTorch reference everywhere (debugging)."
        },
    )
    fastqwen_kernel_preference: dict[str, str] | None = Field(
        default=None,
        json_schema_extra={
            "description": "op -> kernel to try first, e.g. {gated_delta_rule: flash-qla} (FlashQLA's TileLang "
            "GDN kernels, when installed). Still self-checked on the GPU; one that fails or cannot run here "
            "gives way to the default, and the load report says why."
        },
    )
    fastqwen_fused_ce: bool = Field(
        default=True,
        json_schema_extra={"description": "Compute the loss without materialising the vocabulary logits."},
    )
    fastqwen_checkpointing: Literal["full", "auto"] = Field(
        default="full",
        json_schema_extra={
            "description": "With gradient_checkpointing: full recomputes every decoder layer (Axolotl's and HF's "
            "behaviour); auto measures the peak memory of the first steps and keeps the activations of as many "
            "layers as fit under fastqwen_checkpointing_memory of the GPU, recomputing the rest."
        },
    )
    fastqwen_checkpointing_memory: float = Field(
        default=DEFAULT_CHECKPOINTING_MEMORY,
        gt=0.0,
        lt=1.0,
        json_schema_extra={
            "description": "fastqwen_checkpointing: auto: the fraction of the GPU's memory a step's peak allocation "
            "may reach (the rest is left to the allocator's cache and other processes)."
        },
    )

    fastqwen_lean_activations: bool | None = Field(
        default=None,
        json_schema_extra={
            "description": "In decoder layers whose activations are kept (gradient checkpointing off, or the layers "
            "fastqwen_checkpointing: auto keeps), drop the norm and output-gate outputs autograd would hold and "
            "recompute them in backward: the same gradients bit for bit, about a sixth less memory per kept layer at "
            "the 27B shape, so auto keeps more layers. Default (unset): on unless fsdp, deepspeed or torch_compile "
            "is set, or gradient_checkpointing recomputes every layer (the load report says which); true insists "
            "and refuses fsdp, deepspeed and torch_compile; false turns it off."
        },
    )

    @field_validator("fastqwen_token_budget")
    @classmethod
    def _budget_on_grid(cls, value: int | None) -> int | None:
        if value is None:
            return value
        if value <= 0 or value % TOKEN_MULTIPLE:
            up = max(TOKEN_MULTIPLE, -(-value // TOKEN_MULTIPLE) * TOKEN_MULTIPLE)
            raise ValueError(
                f"fastqwen_token_budget must be a positive multiple of {TOKEN_MULTIPLE}, got {value}; "
                f"use e.g. fastqwen_token_budget: {up}"
            )
        return value

    @field_validator("fastqwen_kernel_preference")
    @classmethod
    def _known_ops(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        """An op name that matches nothing would leave the preference silently unused."""
        from .ops import check_op_names

        check_op_names(value or {}, "fastqwen_kernel_preference")
        return value

    @model_validator(mode="before")
    @classmethod
    def _no_unknown_keys(cls, data: Any) -> Any:
        """A misspelt key would be dropped by the config schema and its setting silently lost."""
        if not isinstance(data, dict):
            return data
        known = set(FastQwenArgs.model_fields)
        unknown = sorted(str(k) for k in data if str(k).startswith("fastqwen_") and k not in known)
        if unknown:
            hints = []
            for key in unknown:
                close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.5)
                hints.append(f"`{key}`" + (f" (did you mean `{close[0]}`?)" if close else ""))
            raise ValueError(
                f"unknown axolotl_fastqwen option{'s' if len(unknown) > 1 else ''} {', '.join(hints)}; the "
                f"options are {', '.join(sorted(known))}."
            )
        return data

    @model_validator(mode="before")
    @classmethod
    def _checkpointing_auto_needs(cls, data: Any) -> Any:
        """`auto` sizes itself from measured steps of one static shape, under HF's per-layer checkpointing."""
        if not isinstance(data, dict) or data.get("fastqwen_checkpointing") != "auto":
            return data
        needs = []
        if not data.get("gradient_checkpointing"):
            needs.append("`gradient_checkpointing: true` (auto chooses which layers recompute; without "
                         "checkpointing none does)")
        if not _packing_on(data):
            needs.append("the plugin's packer (`fastqwen_packing: true`): the memory of one step holds for the "
                         "next only with its static-shape rows")
        if data.get("torch_compile") not in (None, False, ""):
            needs.append("no `torch_compile` (each change of the recomputed layers would recompile)")
        if data.get("activation_offloading") not in (None, False, ""):
            needs.append("no `activation_offloading` (offloaded activations do not show in GPU memory, so the "
                         "fit would keep too many)")
        if needs:
            raise ValueError(f"fastqwen_checkpointing: auto needs {'; '.join(needs)}. Fix these or set "
                             "`fastqwen_checkpointing: full`.")
        return data

    @model_validator(mode="before")
    @classmethod
    def _lean_activations_needs(cls, data: Any) -> Any:
        """Its recompute reads the norms' weights in backward, and its hooks run in eager mode."""
        if not isinstance(data, dict) or data.get("fastqwen_lean_activations") is not True:
            return data
        clashes = lean_activations_clashes(data)
        if clashes:
            raise ValueError(
                f"fastqwen_lean_activations cannot be used with {', '.join(f'`{k}`' for k in clashes)}: "
                f"{LEAN_ACTIVATIONS_CLASH_WHY}. Set `fastqwen_lean_activations: false` (or leave it unset) or remove "
                "those keys.")
        return data

    @model_validator(mode="before")
    @classmethod
    def _no_contradictions(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not _packing_on(data):
            return data
        clashes = {
            "sample_packing": "Axolotl's multipack (it does not mask the first label of each packed sequence "
            "and derives boundaries per layer)",
            "batch_flattening": "HF's flattening collator",
            "eval_sample_packing": "Axolotl's multipack for evaluation",
            "pretraining_dataset": "streaming pretraining data (the packer needs every sample's length)",
            "streaming": "streaming datasets (the packer needs every sample's length)",
            "group_by_length": "length-grouped sampling",
            "curriculum_sampling": "curriculum (sequential) sampling",
            "rl": "preference / RL trainers",
            "reward_model": "reward-model training",
        }
        on = [key for key in clashes if data.get(key) not in (None, False, "")]
        if on:
            detail = "; ".join(f"`{key}: {data[key]}` ({clashes[key]})" for key in on)
            raise ValueError(
                f"fastqwen_packing (on by default with the axolotl_fastqwen plugin) replaces the collator and "
                f"sampler, which contradicts {detail}. Remove those keys (set them false) to use the plugin's "
                "packer, or set `fastqwen_packing: false` to keep them (the fused kernels still apply)."
            )
        if (data.get("context_parallel_size") or 1) > 1 or (data.get("sequence_parallel_degree") or 1) > 1:
            raise ValueError(
                "fastqwen_packing does not split packed rows across context-parallel ranks; set "
                "`fastqwen_packing: false` with context_parallel_size > 1."
            )
        return data


def _packing_on(data: dict) -> bool:
    return data.get("fastqwen_packing", True) is not False


def token_budget(cfg) -> int:
    """The configured budget, or sequence_len * micro_batch_size rounded up to the grid."""
    if cfg.get("fastqwen_token_budget"):
        return int(cfg["fastqwen_token_budget"])
    tokens = int(cfg.get("sequence_len") or 2048) * int(cfg.get("micro_batch_size") or 1)
    return -(-tokens // TOKEN_MULTIPLE) * TOKEN_MULTIPLE
