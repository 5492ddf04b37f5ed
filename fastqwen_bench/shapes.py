"""Named model shapes, built fast with random weights directly on the device.

A benchmark needs the real layer shapes, not the real weights: the shapes are the published
configs (shared/reference/landscape.md), `--layers N` cuts depth keeping the 3 GDN : 1 attention
pattern, and weights are drawn on the device from a seeded generator (no checkpoint, no slow
CPU init, and the same values every time a path resets the model).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import math
import sys
import time
from pathlib import Path

import torch
from torch import nn

from axolotl_fastqwen import registry
from axolotl_fastqwen.diagnostics import model_shapes
from axolotl_fastqwen.diagnostics.model_shapes import (  # noqa: F401 (re-exported for the bench and tests)
    DEFAULT_SHAPE, SHAPES, ModelShape, build_config, build_experts, layer_types,
)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
from tiny_assets import toy_config  # noqa: E402 (the toy sizes: one definition, with the test models)


def _shapes() -> dict[str, ModelShape]:
    """The published shapes, and a toy one per family (hidden 64; tools/tiny_assets.py) for CPU runs."""
    out = dict(SHAPES)
    toy_names = {"qwen3_5": "tiny", "qwen3_5_moe": "tiny-moe", "qwen3_next": "tiny-next"}
    for fam in registry.families():
        name = toy_names.get(fam.name, f"tiny-{fam.name}")
        out[name] = ModelShape(name, fam.name, 4, description=f"toy {fam.name} (hidden 64) for CPU smoke runs",
                               make_config=functools.partial(toy_config, fam.name))
    return out


BENCH_SHAPES: dict[str, ModelShape] = _shapes()


def get_shape(name: str) -> ModelShape:
    return model_shapes.get_shape(name, BENCH_SHAPES)


@functools.cache
def _zero_centred(cls: type) -> bool:
    """Qwen's RMSNorms scale by (1 + w) and are initialised to w = 0; the gated one by w (= 1)."""
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False
    return "1.0 + self.weight" in source or "1 + self.weight" in source


@torch.no_grad()
def init_weights_(model: nn.Module, seed: int, std: float, only_trainable: bool = False) -> None:
    """Deterministic random weights, drawn on the parameters' device (fast on a GPU).

    Matrices ~ N(0, std); conv taps ~ U(+-1/sqrt(width)) (PyTorch's default scale); zero-centred
    norms ~ N(0, 0.1), gated norms ~ 1 + N(0, 0.1); A_log / dt_bias in Mamba-2 style ranges so
    some heads keep long memory. LoRA: A ~ U(+-1/sqrt(in)), B = 0 (the model starts at the base).
    """
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    owners = {}
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            owners[id(p)] = (module, name)
    for full_name, p in model.named_parameters():
        if only_trainable and not p.requires_grad:
            continue
        module, name = owners[id(p)]
        cls = type(module).__name__
        if "lora_B" in full_name:
            p.zero_()
        elif "lora_A" in full_name:
            bound = 1.0 / math.sqrt(p.shape[-1])
            p.uniform_(-bound, bound, generator=gen)
        elif name == "A_log":
            p.copy_(torch.empty(p.shape, device=device).uniform_(1.0, 16.0, generator=gen).log())
        elif name == "dt_bias":
            lo, hi = math.log(1e-3), math.log(1e-1)
            dt = torch.empty(p.shape, device=device).uniform_(lo, hi, generator=gen).exp()
            p.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus^-1(dt)
        elif cls.endswith("RMSNormGated") or (cls.endswith("RMSNorm") and not _zero_centred(type(module))):
            p.normal_(1.0, 0.1, generator=gen)
        elif cls.endswith("RMSNorm"):
            p.normal_(0.0, 0.1, generator=gen)
        elif isinstance(module, nn.Conv1d) and name == "weight":
            bound = 1.0 / math.sqrt(p.shape[-1])
            p.uniform_(-bound, bound, generator=gen)
        elif p.dim() >= 2:
            p.normal_(0.0, std, generator=gen)
        else:
            p.zero_()


def _no_init():
    """Skip every init pass at construction (init_weights_ fills the weights afterwards)."""
    for module in ("transformers.initialization", "transformers.modeling_utils"):
        try:
            return getattr(importlib.import_module(module), "no_init_weights")()
        except (ImportError, AttributeError):
            continue
    return _torch_init_off()


@contextlib.contextmanager
def _torch_init_off():
    names = ("uniform_", "normal_", "constant_", "ones_", "zeros_", "kaiming_uniform_", "trunc_normal_")
    saved = {n: getattr(nn.init, n) for n in names}
    try:
        for n in names:
            setattr(nn.init, n, lambda tensor, *a, **k: tensor)
        yield
    finally:
        for n, fn in saved.items():
            setattr(nn.init, n, fn)


def build_model(config, family: str, device: torch.device, dtype: torch.dtype, seed: int) -> tuple[nn.Module, float]:
    """The `*ForCausalLM` of `family`, allocated on `device` in `dtype` with no init pass, then filled by
    `init_weights_`. Returns (model, seconds)."""
    import transformers

    cls = getattr(transformers, registry.family(family).causal_lm)  # (a lazy import: not part of the build time)
    start = time.perf_counter()
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device), _no_init():
            model = cls(config)
    finally:
        torch.set_default_dtype(previous)
    init_weights_(model, seed, std=config.initializer_range)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return model, time.perf_counter() - start


def lora_targets(family: str) -> list[str]:
    """The projections the benchmark's LoRA adapts (peft `target_modules`): the family's own list,
    the same as its examples/ configs (families/*.py say why each is in or out)."""
    return list(registry.family(family).lora_targets)


def lora_target_parameters(family: str, experts: bool) -> list[str]:
    """peft `target_parameters` for LoRA on the routed experts' 3D weights (`--lora-experts`)."""
    if not experts:
        return []
    fam = registry.family(family)
    if not fam.expert_parameters:
        raise ValueError(f"--lora-experts needs an MoE shape; {family} has no routed experts")
    return list(fam.expert_parameters)


def matmul_params_per_token(config) -> dict[str, int]:
    """Weight-matrix parameters each token multiplies through (MoE: only its top-k experts).

    Embedding lookups are not matmuls and are excluded; the lm_head is included.
    """
    H = config.hidden_size
    kinds = list(config.layer_types)
    Hk, Hv = config.linear_num_key_heads, config.linear_num_value_heads
    Dk, Dv = config.linear_key_head_dim, config.linear_value_head_dim
    Hq, Hkv, D = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    gdn = H * (2 * Hk * Dk + Hv * Dv) + H * Hv * Dv + 2 * H * Hv + Hv * Dv * H  # qkv, z, b+a, out
    attn = H * Hq * D * 2 + 2 * H * Hkv * D + Hq * D * H  # q (+ output gate), k, v, o
    experts = getattr(config, "num_experts", 0) or 0
    if experts:
        k = config.num_experts_per_tok
        mlp = H * experts + k * 3 * H * config.moe_intermediate_size
        if getattr(config, "shared_expert_intermediate_size", 0):
            mlp += 3 * H * config.shared_expert_intermediate_size + H  # shared expert + its gate
    else:
        mlp = 3 * H * config.intermediate_size
    n_gdn = kinds.count("linear_attention")
    n_attn = kinds.count("full_attention")
    out = {
        "gated_deltanet": n_gdn * gdn,
        "attention": n_attn * attn,
        "mlp": len(kinds) * mlp,
        "lm_head": H * config.vocab_size,
    }
    out["total"] = sum(out.values())
    return out


def linear_params(model: nn.Module) -> int:
    """nn.Linear weights in the base model, excluding adapters: a cross-check of the dense count."""
    total = 0
    for name, module in model.named_modules():
        if type(module) is nn.Linear and "lora_" not in name:
            total += module.weight.numel()
    return total
