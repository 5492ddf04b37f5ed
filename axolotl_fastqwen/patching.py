"""`patch_model` / `unpatch_model`: install the fused layers on a loaded model, and take them off.

Patches are per instance and reversible: each patched module gets an instance-level `forward`
(the class is untouched, so a stock model in the same process stays stock), the decoder gets one
forward pre-hook that resolves the batch's boundaries once per forward, and `unpatch_model`
deletes exactly what was added. Works on a bare transformers model or under peft / DDP wrappers,
with or without gradient checkpointing, before or after LoRA is applied.
"""

from __future__ import annotations

import copy
import functools
import inspect
import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from . import registry
from .adapters import LoraInputCast
from .boundaries import BOUNDARIES_KWARG, HOST_CU_SEQLENS_KWARG, PADDING_SEGMENTS_KWARG, BoundaryError, resolve
from .families.base import Family, detect_family, unwrap
from .forward_context import ForwardContext
from .kernels import CheckShapes, KernelSet, select_kernels, selfcheck
from .report import format_report
from .layers.attention import attention_forward
from .layers.causal_lm import causal_lm_forward
from .layers.gated_deltanet import gated_deltanet_forward
from .ops import availability

LOG = logging.getLogger("axolotl_fastqwen")
STATE_ATTR = "_fastqwen_patch"


@dataclass
class LayerPatch:
    """What a patched module needs at call time (stored on the module as `_fastqwen`)."""

    family: Family
    kernels: KernelSet
    original_forward: Any
    context: ForwardContext

    def bind(self, args: tuple, kwargs: dict) -> dict:
        """Positional arguments by the names the stock forward gives them (its `**kwargs` merged)."""
        if not args:
            return dict(kwargs)
        signature = inspect.signature(self.original_forward)
        bound = signature.bind_partial(*args, **kwargs)
        out = {}
        for name, value in bound.arguments.items():
            if signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
                out.update(value)
            else:
                out[name] = value
        return out


@dataclass
class PatchReport:
    """What was patched and with which kernels: logged as one table, saved as JSON by the plugin."""

    family: str
    model_class: str
    gated_deltanet_layers: int
    attention_layers: int
    fused_cross_entropy: str
    kernels: KernelSet
    versions: dict[str, str | None]
    boundary_sources: set[str] = field(default_factory=set)
    batch_shapes: dict[str, set] = field(default_factory=lambda: {"train": set(), "eval": set()})

    def backends(self) -> dict[str, str]:
        names = self.kernels.names()
        # Not patched ("off (...)", "delegated to ..."): say so. Patched: the live choice, which the
        # first-forward self-check may have demoted since patch time.
        if self.fused_cross_entropy.startswith(("off", "delegated")):
            names["linear_cross_entropy"] = self.fused_cross_entropy
        if not self.attention_layers:
            names.pop("varlen_attention", None)
        return names

    def to_dict(self) -> dict:
        ops = {}
        for op, choice in self.kernels.choices.items():
            ops[op] = {
                "backend": self.backends().get(op, choice.backend.name),
                "fallback": choice.backend.fallback,
                "selfcheck": choice.selfcheck,
                "rejected": [f"{name}: {why}" for name, why in choice.rejected],
            }
        return {
            "family": self.family,
            "model_class": self.model_class,
            "device": str(self.kernels.device),
            "mode": self.kernels.mode,
            "layers_patched": {"gated_deltanet": self.gated_deltanet_layers, "attention": self.attention_layers},
            "selfchecked": self.kernels.checked and self.kernels.device.type == "cuda",
            "ops": ops,
            "notes": list(self.kernels.notes),
            "boundary_sources": sorted(self.boundary_sources),
            "batch_shapes": {k: sorted(list(s) for s in v) for k, v in self.batch_shapes.items()},
            "versions": self.versions,
        }

    def format(self) -> str:
        return format_report(self.to_dict())


def patch_model(
    model: nn.Module,
    *,
    backend: str = "auto",
    fused_cross_entropy: bool = True,
    device: torch.device | str | None = None,
    prefer: dict[str, str] | None = None,
    log: bool = True,
) -> PatchReport:
    """Replace the Qwen hybrid layers of `model` with the fused, boundary-correct ones.

    backend: "auto" (fastest kernels available, self-checked on the GPU, warn on any fallback),
    "require" (raise if any op would use the PyTorch path) or "reference" (PyTorch everywhere).
    device: where the model will train; defaults to the device of its parameters.
    prefer: op -> backend name to try first, e.g. {"causal_conv": "fla-triton"}.
    log: log the report table now (the Axolotl plugin logs it itself, after adding its notes).
    Returns the report; `unpatch_model(model)` restores the stock forward exactly.
    """
    base = unwrap(model)
    if getattr(base, STATE_ATTR, None) is not None:
        return getattr(base, STATE_ATTR)["report"]
    family = detect_family(base, registry.families())
    if device is None:
        param = next(base.parameters(), None)
        device = param.device if param is not None and param.device.type != "meta" else _default_device()
    kernels = select_kernels(device, backend, prefer=prefer)
    context = ForwardContext()

    gdn_classes = family.classes(family.gated_deltanet)
    attn_classes = family.classes(family.attention)
    patched: list[nn.Module] = []
    hooks = []
    counts = {"gdn": 0, "attn": 0}
    for module in base.modules():
        if type(module) in gdn_classes:
            _check_conv_not_adapted(module)
            _install(module, gated_deltanet_forward, family, kernels, context)
            patched.append(module)
            counts["gdn"] += 1
        elif type(module) in attn_classes:
            _install(module, attention_forward, family, kernels, context)
            patched.append(module)
            counts["attn"] += 1

    report = PatchReport(
        family=family.name,
        model_class=type(base).__name__,
        gated_deltanet_layers=counts["gdn"],
        attention_layers=counts["attn"],
        fused_cross_entropy="off",
        kernels=kernels,
        versions=availability.versions(),
    )
    lora_cast = LoraInputCast(base)
    for module in base.modules():
        if type(module) in family.classes(family.decoder_models):
            hooks.append(module.register_forward_pre_hook(_DecoderPreHook(report, base, lora_cast, context), with_kwargs=True))
    if not hooks:
        raise RuntimeError(f"{type(base).__name__}: no decoder model of {family.decoder_models} found to hook")

    if fused_cross_entropy:
        report.fused_cross_entropy = _patch_causal_lm(base, family, kernels, patched, context)
    base.__dict__[STATE_ATTR] = {"modules": patched, "hooks": hooks, "report": report, "lora_cast": lora_cast,
                                 "context": context}
    if log:
        LOG.info("%s", report.format())
    return report


def unpatch_model(model: nn.Module) -> None:
    """Remove everything `patch_model` installed; the model is stock again, bit for bit."""
    base = unwrap(model)
    state = base.__dict__.pop(STATE_ATTR, None)
    if state is None:
        return
    for handle in state["hooks"]:
        handle.remove()
    state["lora_cast"].restore()
    for module in state["modules"]:
        _uninstall(module)


def is_patched(model: nn.Module) -> bool:
    return STATE_ATTR in unwrap(model).__dict__


def _default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


class PatchedForward:
    """A module's replacement forward, bound to it, that keeps the stock forward's signature.

    The Trainer inspects `model.forward`'s signature to decide which dataset columns to keep and
    whether to pass `num_items_in_batch`; a bare `(*args, **kwargs)` would make it drop
    `input_ids`. Deep copies rebind to the copied module, like a bound method.
    """

    def __init__(self, function, module: nn.Module, signature: inspect.Signature):
        self.function = function
        self.module = module
        self.__signature__ = signature
        functools.update_wrapper(self, function, assigned=("__module__", "__name__", "__qualname__", "__doc__"))

    def __call__(self, *args, **kwargs):
        return self.function(self.module, *args, **kwargs)

    def __deepcopy__(self, memo):
        return PatchedForward(self.function, copy.deepcopy(self.module, memo), self.__signature__)


def _install(module: nn.Module, forward, family: Family, kernels: KernelSet, context: ForwardContext) -> None:
    # accelerate's dispatch hooks keep the real forward in `_old_forward`: patch beneath them
    attr = "_old_forward" if hasattr(module, "_hf_hook") and "_old_forward" in module.__dict__ else "forward"
    original = getattr(module, attr)
    module.__dict__["_fastqwen"] = LayerPatch(family, kernels, original, context)
    module.__dict__["_fastqwen_attr"] = attr
    module.__dict__["_fastqwen_had_instance_forward"] = attr in module.__dict__
    setattr(module, attr, PatchedForward(forward, module, inspect.signature(original)))


def _uninstall(module: nn.Module) -> None:
    patch = module.__dict__.pop("_fastqwen")
    attr = module.__dict__.pop("_fastqwen_attr")
    had_instance = module.__dict__.pop("_fastqwen_had_instance_forward")
    if had_instance:
        setattr(module, attr, patch.original_forward)
    else:
        del module.__dict__[attr]


def _check_conv_not_adapted(module: nn.Module) -> None:
    conv = module.conv1d
    if not isinstance(conv, nn.Conv1d) or type(conv) is not nn.Conv1d:
        raise ValueError(
            f"{type(module).__name__}.conv1d is wrapped ({type(conv).__name__}); the fused path reads the conv "
            "weight directly and would ignore an adapter on it. Remove `conv1d` from lora_target_modules "
            "(LoRA on in_proj_qkv / in_proj_z / out_proj and the attention and MLP projections is supported)."
        )


def _patch_causal_lm(base: nn.Module, family: Family, kernels: KernelSet, patched: list, context) -> str:
    lm_classes = family.classes(family.causal_lms)
    if type(base) not in lm_classes:
        return f"off ({type(base).__name__} is not one of {family.causal_lms})"
    head = base.lm_head
    if type(head) is not nn.Linear or head.bias is not None:
        return f"off (lm_head is {type(head).__name__}: an adapter or bias on it needs the stock loss)"
    _install(base, causal_lm_forward, family, kernels, context)
    patched.append(base)
    return kernels.choices["linear_cross_entropy"].backend.name


class _DecoderPreHook:
    """Forward pre-hook on the decoder: everything decided once per forward, before the first layer.

    In order: the GPU self-check (first forward only), peft's LoRA input cast (`adapters.py`), the
    batch-shape record for the report, then the boundaries (`boundaries.resolve`). A packed batch
    gets one boundaries object for every layer, no 4-D masks (the varlen kernels need none) and no
    cache (a packed row is not a prefix to continue; an empty cache object passed in is ignored
    with a warning, a filled one refused). Unpacked and generation batches pass through unchanged.
    """

    def __init__(self, report: PatchReport, base: nn.Module, lora_cast: LoraInputCast, context: ForwardContext):
        self.report = report
        self.base = base
        self.lora_cast = lora_cast
        self.context = context
        self.validated = False

    def __call__(self, module, args, kwargs):
        self._selfcheck_once()
        self._lora_input_cast()
        host = kwargs.pop(HOST_CU_SEQLENS_KWARG, None)
        padding = kwargs.pop(PADDING_SEGMENTS_KWARG, None)
        self._record_shape(module.training, args, kwargs)
        if module.training:
            kwargs["use_cache"] = False
        self.context.last_boundaries = kwargs.get(BOUNDARIES_KWARG)
        if self.context.last_boundaries is not None:
            return args, kwargs
        device = _input_device(args, kwargs)
        position_ids = kwargs.get("position_ids")
        text_positions = position_ids[0] if position_ids is not None and position_ids.dim() == 3 else position_ids
        validate = device.type != "cuda" or not self.validated  # on a GPU each check is a sync: check once
        boundaries = resolve(
            device=device, position_ids=text_positions, attention_mask=kwargs.get("attention_mask"),
            cu_seq_lens_q=kwargs.get("cu_seq_lens_q"), host_cu_seqlens=host, seq_idx=kwargs.get("seq_idx"),
            max_length_q=kwargs.get("max_length_q"), padding_segments=padding, validate=validate,
        )
        if boundaries is None:
            return args, kwargs
        self.validated = True
        self._no_cache_on_packed_rows(kwargs)
        self.report.boundary_sources.add(boundaries.source)
        self.context.last_boundaries = boundaries
        kwargs[BOUNDARIES_KWARG] = boundaries
        kwargs["attention_mask"] = {"full_attention": None, "linear_attention": None}
        return args, kwargs

    def _selfcheck_once(self) -> None:
        kernels = self.report.kernels
        if not kernels.checked:
            selfcheck(kernels, _check_shapes(self.base))
            LOG.info("%s", self.report.format())

    def _lora_input_cast(self) -> None:
        self.lora_cast.update(self.report.kernels.device.type)
        note = self.lora_cast.describe()
        if note and note not in self.report.kernels.notes:
            self.report.kernels.notes.append(note)

    def _record_shape(self, training: bool, args, kwargs) -> None:
        shape = _input_shape(args, kwargs)
        seen = self.report.batch_shapes["train" if training else "eval"]
        # under torch.export / dynamic shapes the dims are SymInts: not recorded (and not pinned by int())
        if shape is not None and len(seen) < 64 and all(type(d) is int for d in shape):
            seen.add(shape)

    def _no_cache_on_packed_rows(self, kwargs) -> None:
        cache = kwargs.get("past_key_values")
        if cache is not None:
            filled = cache.get_seq_length() if hasattr(cache, "get_seq_length") else 1
            if filled:
                raise BoundaryError(
                    f"a packed batch (several sequences per row) was passed with a cache holding {filled} "
                    "tokens; a packed row cannot continue a cache. Generate from unpacked (padded) batches."
                )
            note = "an empty cache passed with packed rows was ignored (a packed row is not a prefix to continue)"
            if note not in self.report.kernels.notes:
                self.report.kernels.notes.append(note)
                LOG.warning("axolotl_fastqwen: %s; past_key_values of that output is None", note)
            kwargs["past_key_values"] = None
        kwargs["use_cache"] = False


def _input_shape(args, kwargs) -> tuple[int, ...] | None:
    for value in (kwargs.get("input_ids"), kwargs.get("inputs_embeds"), *args):
        if isinstance(value, torch.Tensor):
            return tuple(value.shape[:2])
    return None


def _input_device(args, kwargs) -> torch.device:
    for value in (kwargs.get("input_ids"), kwargs.get("inputs_embeds"), *args):
        if isinstance(value, torch.Tensor):
            return value.device
    raise ValueError("cannot tell the batch's device: no input_ids or inputs_embeds")


def _check_shapes(base: nn.Module) -> CheckShapes:
    gdn = next(m for m in base.modules() if hasattr(m, "_fastqwen") and hasattr(m, "A_log"))
    attn = next((m for m in base.modules() if hasattr(m, "_fastqwen") and hasattr(m, "q_norm")), None)
    dtype = gdn.conv1d.weight.dtype  # the compute dtype (in_proj weights may be 4-bit under QLoRA)
    return CheckShapes(
        key_heads=gdn.num_k_heads,
        value_heads=gdn.num_v_heads,
        key_dim=gdn.head_k_dim,
        value_dim=gdn.head_v_dim,
        conv_width=gdn.conv_kernel_size,
        q_heads=attn.config.num_attention_heads if attn is not None else 1,
        kv_heads=attn.config.num_key_value_heads if attn is not None else 1,
        head_dim=attn.head_dim if attn is not None else 64,
        dtype=dtype,
    )

