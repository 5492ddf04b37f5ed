"""What a model family must tell the patcher, and how a loaded model is matched to one.

A family names its classes in a transformers modeling module (resolved lazily, so an old
transformers without that model simply offers no classes) and knows how its Gated DeltaNet layer
projects the hidden states into conv input, output gate, beta and decay inputs. Everything after
that projection is shared by all families.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

# (mixed_qkv [B, T, 2*key_dim + value_dim], z [B, T, Hv, Dv], b [B, T, Hv], a [B, T, Hv])
Projection = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


class UnsupportedModelError(ValueError):
    """The model is not a Qwen hybrid variant this plugin knows how to patch."""


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]
    modeling_module: str
    gated_deltanet: tuple[str, ...]
    attention: tuple[str, ...]
    decoder_models: tuple[str, ...]  # the modules that own the layer stack (boundaries resolved here)
    causal_lms: tuple[str, ...]  # modules with `lm_head` whose loss can be fused
    project_gated_deltanet: Callable[[nn.Module, torch.Tensor], Projection]

    def module(self):
        try:
            return importlib.import_module(self.modeling_module)
        except ImportError:
            return None

    def classes(self, names: tuple[str, ...]) -> tuple[type, ...]:
        module = self.module()
        if module is None:
            return ()
        return tuple(getattr(module, n) for n in names if hasattr(module, n))

    def rotary(self) -> Callable:
        """The family's own `apply_rotary_pos_emb` (partial rotary, Qwen's layout)."""
        return self.module().apply_rotary_pos_emb


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


def detect_family(model: nn.Module, families: list[Family]) -> Family:
    """The family whose Gated DeltaNet class (exactly) is in `model`; raise for anything else."""
    base = unwrap(model)
    model_type = getattr(getattr(base, "config", None), "model_type", None)
    gdn_types = {type(m) for m in base.modules() if "GatedDeltaNet" in type(m).__name__}
    for family in families:
        known = set(family.classes(family.gated_deltanet))
        if gdn_types and gdn_types <= known:
            return family
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
