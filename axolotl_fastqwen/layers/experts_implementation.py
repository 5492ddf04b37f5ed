"""Who runs the routed experts of an MoE model: read from the live model for the load report.

transformers dispatches each experts module's forward through its `ExpertsInterface` by
`config._experts_implementation` at every call (eager, grouped_mm, batched_mm, ... or what an
integration registered: Axolotl's KernelsPlugin registers `scattermoe`; the plugin registers
`fastqwen_grouped`, `layers/grouped_experts.py`, and sets it where a model would run `grouped_mm`),
and a kernel library may replace the class outright (Liger's `LigerExperts` on qwen3_next). Which
one runs is therefore only known from the model as it trains, and it can change after load
(`set_experts_implementation`), so the report reads it whenever it is written.
"""

from __future__ import annotations

from collections import Counter

from torch import nn
from torch.nn.utils import parametrize

from .quantized_stacks import describe_unreadable, stack_meta

EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")


def is_experts(module: nn.Module) -> bool:
    """A routed-experts module: 3-D stacked expert weights, whatever class holds them (peft's
    `target_parameters` wrappers around one do not show its weights: it is counted once), plain or stored
    quantized behind a parametrization (`quantized_stacks.py`; any parametrization: an unknown one is
    still an experts module, which the report then names)."""
    for name in EXPERT_WEIGHTS:
        if parametrize.is_parametrized(module, name):
            meta = stack_meta(module, name)
            if meta is not None and len(meta.shape) != 3:
                return False
        elif not (isinstance(getattr(module, name, None), nn.Parameter) and getattr(module, name).dim() == 3):
            return False
    return True


def experts_class(module: nn.Module) -> type:
    """The module's own class: torch's parametrize subclasses it as `Parametrized<Class>`."""
    return parametrize.type_before_parametrizations(module)


def stacks_note(module: nn.Module) -> str | None:
    """How the stacks are stored, where not as plain tensors (the report's line)."""
    metas = {name: stack_meta(module, name) for name in EXPERT_WEIGHTS}
    unreadable = [describe_unreadable(module, name) or f"{name}: not a tensor" for name, m in metas.items() if m is None]
    if unreadable:
        return "; ".join(unreadable)
    quantized = {name: m for name, m in metas.items() if m.quantization}
    if not quantized:
        return None
    kinds = sorted({f"{m.quantization}, dequantized to {str(m.dtype).removeprefix('torch.')}" for m in quantized.values()})
    return f"{' and '.join(quantized)} stored as {'; '.join(kinds)} (quantize_moe_experts)"


def experts_modules(model: nn.Module) -> list[nn.Module]:
    """The model's routed-experts modules, in model order."""
    return [module for module in model.modules() if is_experts(module)]


def experts_implementation(module: nn.Module) -> str | None:
    """The `experts_implementation` an experts module dispatches by now (read at every call)."""
    return getattr(getattr(module, "config", None), "_experts_implementation", None)


def set_experts_implementation(model: nn.Module, implementation: str) -> None:
    """Through transformers' own setter where the model has it (sub-configs follow)."""
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation(implementation)
    else:
        model.config._experts_implementation = implementation


def registered_implementations() -> list[str] | None:
    """The names transformers' `ExpertsInterface` dispatches here ("eager" first); None without it."""
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError:
        return None
    keys = ALL_EXPERTS_FUNCTIONS.valid_keys() if hasattr(ALL_EXPERTS_FUNCTIONS, "valid_keys") else []
    return ["eager", *sorted(set(keys) - {"eager"})]


def _runner(module: nn.Module, implementation: str | None) -> str:
    cls = experts_class(module)
    where = f"{cls.__module__}.{cls.__qualname__}"
    dispatched = getattr(cls.forward, "__wrapped__", None) is not None and cls.__module__.startswith("transformers.")
    if not dispatched:
        return f"{where}.forward (class-level replacement; config._experts_implementation not consulted)"
    if implementation in (None, "eager"):
        return f"{where}.forward (transformers eager: a loop over the experts that received tokens)"
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

        fn = ALL_EXPERTS_FUNCTIONS[implementation]
        return f"{fn.__module__}.{fn.__qualname__} (transformers ExpertsInterface '{implementation}')"
    except (ImportError, KeyError) as exc:
        return f"'{implementation}' is not registered in transformers' ExpertsInterface ({type(exc).__name__})"


def describe_experts(model: nn.Module) -> dict | None:
    """{modules, class, implementation, runner} of the model's routed experts; None for a dense model.

    Mixed settings (one implementation per module is possible) are listed in `by_module_kind`.
    """
    found = experts_modules(model)
    if not found:
        return None
    kinds = Counter()
    for module in found:
        impl = experts_implementation(module)
        kinds[(experts_class(module).__qualname__, impl, _runner(module, impl))] += 1
    (cls, impl, runner), _ = kinds.most_common(1)[0]
    out = {"modules": len(found), "class": cls, "implementation": impl, "runner": runner}
    stacks = stacks_note(found[0])
    if stacks is not None:
        out["stacks"] = stacks
    if len(kinds) > 1:
        out["by_module_kind"] = [{"modules": n, "class": c, "implementation": i, "runner": r}
                                 for (c, i, r), n in kinds.most_common()]
    return out
