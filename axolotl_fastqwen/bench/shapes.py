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

from .. import registry

FULL_ATTENTION_EVERY = 4  # layers 3, 7, 11, ... are full attention; the rest Gated DeltaNet

# Toy-size models (CPU smoke runs of the bench; tools/tiny_assets.py builds the test models from
# the same numbers): the real architectures at hidden 64.
TOY_TEXT = dict(
    hidden_size=64,
    # Gated full attention, GQA 4 q / 2 kv. head_dim 32 -> rotary dim 8 -> 4 frequencies, the
    # smallest size at which all three interleaved MRoPE sections (T, H, W) are non-empty.
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    # Gated DeltaNet with grouped value heads (2 v per k; the 27B has 48 v / 16 k).
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    max_position_embeddings=32768,
    # ~1/sqrt(hidden): every sub-layer contributes O(1) to the residual stream, so a kernel bug
    # in any layer shows in the logits (the 0.02 default leaves a 64-wide model nearly linear).
    initializer_range=0.1,
    tie_word_embeddings=False,
)
TOY_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
TOY_VOCAB = 512
REAL_MROPE_SECTION = (11, 11, 10)


def scaled_mrope_section(rotary_dim: int, real: tuple[int, ...] = REAL_MROPE_SECTION) -> list[int]:
    """Scale the real [11, 11, 10] section to ``rotary_dim // 2`` frequencies (largest remainder).

    The text rotary embedding interleaves T/H/W over ``rotary_dim // 2`` frequencies using the
    section lengths, so their sum must match the toy rotary dim or the model will not run.
    """
    n_freq = rotary_dim // 2
    if n_freq < 1:
        raise ValueError(f"rotary_dim {rotary_dim} has no frequencies")
    total = sum(real)
    exact = [s * n_freq / total for s in real]
    section = [math.floor(x) for x in exact]
    by_remainder = sorted(range(len(real)), key=lambda i: (-(exact[i] - section[i]), i))
    for i in by_remainder[: n_freq - sum(section)]:
        section[i] += 1
    return section


def toy_config(family: str, *, vocab_size: int = TOY_VOCAB, num_hidden_layers: int = 4, **overrides):
    """A toy-size text config of `family` with the real layer pattern (3 GDN : 1 full attention).

    `overrides` replace any field. Unless `rope_parameters` is overridden, the MRoPE section is
    recomputed from the final head_dim, so overriding the head size keeps it valid."""
    import transformers

    fam = registry.family(family)
    kwargs = dict(TOY_TEXT, vocab_size=vocab_size, num_hidden_layers=num_hidden_layers)
    if fam.moe:
        kwargs.update(TOY_MOE)
    kwargs.update(dict(fam.toy))
    kwargs.update(overrides)
    if "rope_parameters" not in overrides:
        partial = kwargs.pop("partial_rotary_factor", 0.25)
        rope = {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": partial}
        if fam.mrope:
            rope.update(mrope_section=scaled_mrope_section(int(kwargs["head_dim"] * partial)), mrope_interleaved=True)
        kwargs["rope_parameters"] = rope
    return getattr(transformers, fam.text_config)(**kwargs)


@dataclass(frozen=True)
class ModelShape:
    name: str
    family: str
    layers: int
    config: dict = field(default_factory=dict)
    description: str = ""
    tiny: bool = False


def _shapes() -> dict[str, ModelShape]:
    out = {}
    for fam in registry.families():
        for shape in fam.shapes:
            out[shape.name] = ModelShape(shape.name, fam.name, shape.layers, shape.config, shape.description)
    toy_names = {"qwen3_5": "tiny", "qwen3_5_moe": "tiny-moe", "qwen3_next": "tiny-next"}
    for fam in registry.families():
        name = toy_names.get(fam.name, f"tiny-{fam.name}")
        out[name] = ModelShape(name, fam.name, 4, description=f"toy {fam.name} (hidden 64) for CPU smoke runs", tiny=True)
    return out


SHAPES: dict[str, ModelShape] = _shapes()
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
        config = toy_config(shape.family, num_hidden_layers=n, layer_types=layer_types(n))
    else:
        config = getattr(transformers, registry.family(shape.family).text_config)(
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


def build_experts(shape: ModelShape, device: torch.device, dtype: torch.dtype, seed: int = 0,
                  experts: int | None = None, implementation: str = "grouped_mm") -> nn.Module | None:
    """One routed-experts module of `shape` (its family's transformers class, random weights of the
    bench's scale, `experts` of them: default the shape's count) set to run `implementation`
    (default: what `from_pretrained` picks on a GPU); None for a dense shape. The doctor and the
    GPU tests check the experts implementation on it."""
    config = build_config(shape, layers=1)
    if not getattr(config, "num_experts", 0):
        return None
    if experts is not None:
        config.num_experts = experts
    config._experts_implementation = implementation
    modeling = registry.family(shape.family).module()
    (cls,) = [getattr(modeling, name) for name in dir(modeling) if name.endswith("Experts")]
    torch.manual_seed(seed)
    with torch.device(device):
        module = cls(config).to(dtype)
    for weight in module.parameters():
        nn.init.normal_(weight, std=0.02)
    return module


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
