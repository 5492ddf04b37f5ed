"""The published Qwen hybrid model shapes (each family's `shapes`), as transformers text configs cut
to any depth with the real 3 Gated DeltaNet : 1 attention pattern. The doctor self-checks kernels
at them; the benchmark (fastqwen_bench, outside the package) builds its models from them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from .. import registry

FULL_ATTENTION_EVERY = 4  # layers 3, 7, 11, ... are full attention; the rest Gated DeltaNet
DEFAULT_SHAPE = "qwen3.5-27b"


@dataclass(frozen=True)
class ModelShape:
    name: str
    family: str
    layers: int
    config: dict = field(default_factory=dict)
    description: str = ""
    make_config: Callable | None = None  # builds the text config itself (the benchmark's toy shapes)

    @property
    def tiny(self) -> bool:
        return self.make_config is not None


def published_shapes() -> dict[str, ModelShape]:
    return {shape.name: ModelShape(shape.name, fam.name, shape.layers, shape.config, shape.description)
            for fam in registry.families() for shape in fam.shapes}


SHAPES: dict[str, ModelShape] = published_shapes()


def get_shape(name: str, shapes: dict[str, ModelShape] = SHAPES) -> ModelShape:
    try:
        return shapes[name]
    except KeyError:
        raise ValueError(f"unknown model shape {name!r}; known: {', '.join(shapes)}") from None


def layer_types(n: int) -> list[str]:
    return ["full_attention" if (i + 1) % FULL_ATTENTION_EVERY == 0 else "linear_attention" for i in range(n)]


def build_config(shape: ModelShape, layers: int | None = None, attn_implementation: str = "sdpa"):
    """The transformers text config of `shape`, cut to `layers` (default: full depth)."""
    import transformers

    n = shape.layers if layers is None else int(layers)
    if n < 1:
        raise ValueError(f"--layers must be >= 1, got {n}")
    if shape.make_config is not None:
        config = shape.make_config(num_hidden_layers=n, layer_types=layer_types(n))
    else:
        config = getattr(transformers, registry.family(shape.family).text_config)(
            num_hidden_layers=n, layer_types=layer_types(n), **shape.config
        )
    config.use_cache = False  # training: no cache (a cache silently disables packed masks)
    config._attn_implementation = attn_implementation
    return config


def build_experts(shape: ModelShape, device: torch.device, dtype: torch.dtype, seed: int = 0,
                  experts: int | None = None, implementation: str = "grouped_mm") -> nn.Module | None:
    """One routed-experts module of `shape` (its family's transformers class, random weights of the
    benchmark's scale, `experts` of them: default the shape's count) set to run `implementation`
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


