"""What a model family is, in one place, and how a loaded model is matched to one.

A `Family` holds every fact about a family that any part of the project needs: its model types,
the transformers module and class names (config, causal LM, vision-language wrapper, decoder,
Gated DeltaNet, attention), how its Gated DeltaNet layer projects its input, the LoRA targets of
its examples and benchmark, whether it routes experts, and the Axolotl and Liger functions that
patch it. The patcher, the config check, the benchmark, the stock-kernel control, the asset
builders and the tests all read these fields; adding a family is one new module under families/.

`Family.resolve()` looks the classes up once and returns a `FamilyPlan`, which the patcher uses.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch
from torch import nn

# (mixed_qkv [B, T, 2*key_dim + value_dim], z [B, T, Hv, Dv], b [B, T, Hv], a [B, T, Hv])
Projection = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


class UnsupportedModelError(ValueError):
    """The model is not a Qwen hybrid variant this plugin knows how to patch."""


@dataclass(frozen=True)
class AxolotlNames:
    """The functions Axolotl 0.21 (and Liger) apply to this family: `(module, function)` pairs."""

    packing: tuple[str, str]  # its `sample_packing` patch (PatchManager)
    liger: tuple[str, str]  # what its LigerPlugin calls for this model type
    fused_attn: tuple[str, str] | None = None  # `fused_attn_kernel` (q/k RMSNorm + RoPE), if it has one


@dataclass(frozen=True)
class PublishedShape:
    """A released checkpoint's text config (the fields that set the compute), for the benchmark."""

    name: str  # e.g. "qwen3.5-27b"
    layers: int
    config: dict
    description: str


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]  # every config.model_type of the family (text and composite)
    modeling_module: str
    text_config: str  # the text-model config class (transformers top-level name)
    causal_lm: str  # the text-only *ForCausalLM
    gated_deltanet: str
    attention: str
    decoder: str  # the module that owns the layer stack (boundaries are resolved there)
    project_gated_deltanet: Callable[[nn.Module, torch.Tensor], Projection]
    lora_targets: tuple[str, ...]  # peft target_modules of the examples and the benchmark
    axolotl: AxolotlNames | None = None  # None: Axolotl has no patches of its own for this family
    composite_config: str | None = None  # the vision-language checkpoint config (published checkpoints)
    conditional_generation: str | None = None  # its *ForConditionalGeneration
    moe: bool = False  # routes tokens to experts (an auxiliary load-balancing loss)
    aux_loss: str | None = None  # the modeling module's load-balancing function
    moe_block: str | None = None  # the sparse block (router, routed experts, gated shared expert)
    expert_parameters: tuple[str, ...] = ()  # peft target_parameters for LoRA on the routed experts
    mrope: bool = True  # interleaved multimodal RoPE sections in the text rotary (Qwen3.5)
    layer_norms: tuple[str, ...] = ("input_layernorm", "post_attention_layernorm")  # each decoder layer's RMSNorms
    rms_norm: str | None = None  # the zero-centred RMSNorm class (decoder, q/k and final norms), run by the rms_norm op
    mlp: str | None = None  # the dense SwiGLU MLP class (MoE: the shared expert's), its SiLU-multiply run by the swiglu op
    shapes: tuple[PublishedShape, ...] = ()  # released model sizes (diagnostics/model_shapes.py)
    toy: tuple[tuple[str, object], ...] = ()  # config fields the toy-size model of this family adds

    @property
    def causal_lms(self) -> tuple[str, ...]:
        """The classes with an `lm_head` whose loss can be fused."""
        return tuple(n for n in (self.causal_lm, self.conditional_generation) if n)

    def module(self) -> ModuleType | None:
        try:
            return importlib.import_module(self.modeling_module)
        except ImportError:  # a transformers without this model
            return None

    def resolve(self) -> FamilyPlan | None:
        """The family's classes, looked up once; None when this transformers does not have it."""
        module = self.module()
        if module is None or not hasattr(module, self.gated_deltanet):
            return None

        def classes(*names):
            return tuple(getattr(module, n) for n in names if n and hasattr(module, n))

        # only transformers' own class: `liger_rms_norm` replaces the module's name with Liger's class
        norms = tuple(c for c in classes(self.rms_norm) if c.__module__ == module.__name__)
        mlps = tuple(c for c in classes(self.mlp) if c.__module__ == module.__name__)  # likewise liger_glu_activation
        return FamilyPlan(
            family=self, module=module, gated_deltanet=classes(self.gated_deltanet), attention=classes(self.attention),
            decoder=classes(self.decoder), causal_lm=classes(*self.causal_lms), rms_norm=norms,
            moe_block=classes(self.moe_block), mlp=mlps,
        )


@dataclass(frozen=True)
class FamilyPlan:
    """A family's classes in the installed transformers: what `patch_model` installs against."""

    family: Family
    module: ModuleType
    gated_deltanet: tuple[type, ...]
    attention: tuple[type, ...]
    decoder: tuple[type, ...]
    causal_lm: tuple[type, ...]
    rms_norm: tuple[type, ...] = ()
    moe_block: tuple[type, ...] = ()
    mlp: tuple[type, ...] = ()

    @property
    def name(self) -> str:
        return self.family.name

    def __deepcopy__(self, memo):  # immutable facts about the installed transformers: shared, like the classes
        return self

    def rotary(self) -> Callable:
        """The family's own `apply_rotary_pos_emb` (partial rotary, Qwen's layout)."""
        return self.module.apply_rotary_pos_emb

    def project_gated_deltanet(self, layer: nn.Module, hidden_states: torch.Tensor) -> Projection:
        return self.family.project_gated_deltanet(layer, hidden_states)

    def load_balancing_loss(self) -> Callable:
        return getattr(self.module, self.family.aux_loss)


def unwrap(model: nn.Module) -> nn.Module:
    """The transformers model under peft / DDP / compile wrappers."""
    for _ in range(8):
        if hasattr(model, "get_base_model") and callable(model.get_base_model):
            inner = model.get_base_model()
        elif hasattr(model, "module") and isinstance(model.module, nn.Module):
            inner = model.module
        elif hasattr(model, "_orig_mod"):
            inner = model._orig_mod
        else:
            return model
        if inner is model:
            return model
        model = inner
    return model


def detect_family(model: nn.Module, families: list[Family]) -> FamilyPlan:
    """The plan of the family whose Gated DeltaNet class (exactly) is in `model`; raise for anything else."""
    base = unwrap(model)
    model_type = getattr(getattr(base, "config", None), "model_type", None)
    gdn_types = {type(m) for m in base.modules() if "GatedDeltaNet" in type(m).__name__}
    for family in families:
        plan = family.resolve()
        if plan is not None and gdn_types and gdn_types <= set(plan.gated_deltanet):
            return plan
    supported = sorted({t for f in families for t in f.model_types})
    if gdn_types:
        names = ", ".join(sorted(f"{t.__module__}.{t.__qualname__}" for t in gdn_types))
        raise UnsupportedModelError(
            f"unknown Gated DeltaNet variant {names} (model_type {model_type!r}): axolotl_fastqwen "
            f"patches only the stock transformers classes of {supported}. Remove the plugin from "
            "`plugins:` for this model, or register a family for it (see README, 'Extending')."
        )
    raise UnsupportedModelError(
        f"model_type {model_type!r} ({type(base).__name__}) has no Gated DeltaNet layers; "
        f"axolotl_fastqwen supports {supported}. Remove `axolotl_fastqwen` from `plugins:` for this model."
    )
