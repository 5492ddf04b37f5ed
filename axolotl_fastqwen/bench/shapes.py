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
import time
from dataclasses import dataclass, field

import torch
from torch import nn

FULL_ATTENTION_EVERY = 4  # layers 3, 7, 11, ... are full attention; the rest Gated DeltaNet

_CONFIG_CLASSES = {
    "qwen3_5": "Qwen3_5TextConfig",
    "qwen3_5_moe": "Qwen3_5MoeTextConfig",
    "qwen3_next": "Qwen3NextConfig",
}
_CAUSAL_LM_CLASSES = {
    "qwen3_5": "Qwen3_5ForCausalLM",
    "qwen3_5_moe": "Qwen3_5MoeForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",
}
_MROPE = dict(mrope_section=[11, 11, 10], mrope_interleaved=True)
_ROPE_35 = dict(rope_type="default", rope_theta=10_000_000.0, partial_rotary_factor=0.25, **_MROPE)
_ROPE_NEXT = dict(rope_type="default", rope_theta=10_000_000.0, partial_rotary_factor=0.25)
_GDN_128 = dict(linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4)


@dataclass(frozen=True)
class ModelShape:
    name: str
    family: str
    layers: int
    config: dict = field(default_factory=dict)
    description: str = ""
    tiny: bool = False


SHAPES: dict[str, ModelShape] = {
    s.name: s
    for s in (
        ModelShape(
            "qwen3.5-27b", "qwen3_5", 64,
            dict(hidden_size=5120, intermediate_size=17408, num_attention_heads=24, num_key_value_heads=4,
                 head_dim=256, linear_num_key_heads=16, linear_num_value_heads=48, vocab_size=248_320,
                 tie_word_embeddings=False, rope_parameters=_ROPE_35, **_GDN_128),
            "Qwen3.5/3.6-27B dense: hidden 5120, [3 GDN, 1 full] x16, 24q/4kv x256, GDN 16k/48v x128",
        ),
        ModelShape(
            "qwen3.5-35b-a3b", "qwen3_5_moe", 40,
            dict(hidden_size=2048, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
                 linear_num_key_heads=16, linear_num_value_heads=32, num_experts=256, num_experts_per_tok=8,
                 moe_intermediate_size=512, shared_expert_intermediate_size=512, vocab_size=248_320,
                 tie_word_embeddings=False, rope_parameters=_ROPE_35, **_GDN_128),
            "Qwen3.5-35B-A3B MoE: hidden 2048, 40 layers, 16q/2kv x256, GDN 16k/32v x128, 256 experts top-8",
        ),
        ModelShape(
            "qwen3-next-80b-a3b", "qwen3_next", 48,
            dict(hidden_size=2048, intermediate_size=5120, num_attention_heads=16, num_key_value_heads=2,
                 head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32, num_experts=512,
                 num_experts_per_tok=10, moe_intermediate_size=512, shared_expert_intermediate_size=512,
                 decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True, vocab_size=151_936,
                 tie_word_embeddings=False, rope_parameters=_ROPE_NEXT, **_GDN_128),
            "Qwen3-Next-80B-A3B: hidden 2048, 48 layers, 512 experts top-10, fused in_proj_qkvz/ba",
        ),
        ModelShape("tiny", "qwen3_5", 4, description="toy qwen3_5 (hidden 64) for CPU smoke runs", tiny=True),
        ModelShape("tiny-moe", "qwen3_5_moe", 4, description="toy qwen3_5_moe for CPU smoke runs", tiny=True),
        ModelShape("tiny-next", "qwen3_next", 4, description="toy qwen3_next for CPU smoke runs", tiny=True),
    )
}
DEFAULT_SHAPE = "qwen3.5-27b"


def get_shape(name: str) -> ModelShape:
    try:
        return SHAPES[name]
    except KeyError:
        raise ValueError(f"unknown model shape {name!r}; known: {', '.join(SHAPES)}") from None


def layer_types(n: int) -> list[str]:
    return ["full_attention" if (i + 1) % FULL_ATTENTION_EVERY == 0 else "linear_attention" for i in range(n)]


def build_config(shape: ModelShape, layers: int | None = None, attn_implementation: str = "sdpa"):
    """The transformers text config of `shape`, cut to `layers` (default: full depth)."""
    import transformers

    n = shape.layers if layers is None else int(layers)
    if n < 1:
        raise ValueError(f"--layers must be >= 1, got {n}")
    if shape.tiny:
        from ..tools.tiny_assets import tiny_config

        config = tiny_config(shape.family, num_hidden_layers=n, layer_types=layer_types(n))
    else:
        config = getattr(transformers, _CONFIG_CLASSES[shape.family])(
            num_hidden_layers=n, layer_types=layer_types(n), **shape.config
        )
    config.use_cache = False  # training: no cache (a cache silently disables packed masks)
    config._attn_implementation = attn_implementation
    return config


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

    cls = getattr(transformers, _CAUSAL_LM_CLASSES[family])  # (a lazy import: not part of the build time)
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
    """The projections the brief's LoRA adapts (peft `target_modules`): attention q/k/v/o, the GDN
    projections and the MLP (MoE: the shared expert), as in the examples/ configs.

    qwen3_5 / qwen3_5_moe: `gate_proj` / `up_proj` / `down_proj` are the dense MLP / the shared
    expert (the routed experts are 3D parameters that `target_modules` does not reach).
    qwen3_next: Qwen3-Next fuses q|k|v|z into `in_proj_qkvz`; and for model_type qwen3_next peft
    0.21 rewrites gate/up/down_proj (even `shared_expert.gate_proj`) into LoRA on the routed
    experts' 3D parameters (its v4 -> v5 MoE conversion), leaving the shared expert bare: so they
    are left out here (`--lora-experts` adds the routed experts explicitly).
    """
    attention = ["q_proj", "k_proj", "v_proj", "o_proj", "out_proj"]
    if family == "qwen3_next":
        return attention + ["in_proj_qkvz"]
    return attention + ["gate_proj", "up_proj", "down_proj", "in_proj_qkv", "in_proj_z"]


def lora_target_parameters(family: str, experts: bool) -> list[str]:
    """peft `target_parameters` for LoRA on the routed experts' 3D weights (`--lora-experts`)."""
    if not experts:
        return []
    if family not in ("qwen3_5_moe", "qwen3_next"):
        raise ValueError(f"--lora-experts needs an MoE shape; {family} has no routed experts")
    return ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


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
