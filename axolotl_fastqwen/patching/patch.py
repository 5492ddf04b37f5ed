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
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .. import registry
from .lora_input_cast import LoraInputCast
from .decoder_hook import DecoderPreHook
from ..devices import model_device
from .expert_lora import ExpertAdapters
from .fp8_weights import Fp8Weights
from .fused_lora import FusedLora
from .mlp_chunks import MlpChunks
from .moe_cuda_graphs import MoeCudaGraphs
from ..memory.checkpoint_offload import CheckpointOffload
from ..layers.experts_implementation import describe_experts, experts_implementation, experts_modules, set_experts_implementation
from ..families.base import FamilyPlan, detect_family, unwrap
from .forward_context import ForwardContext
from ..layers.forward_slot import bound_forward, forward_attr
from ..kernel_choice import KernelSet, hopper_guard, select_kernels
from ..layers.attention import attention_forward
from ..layers import grouped_experts
from ..layers.causal_lm import causal_lm_forward
from ..layers.gated_deltanet import gated_deltanet_forward
from ..layers.mlp import runs_silu, swiglu_mlp_forward
from ..layers.moe_block import sparse_moe_block_forward
from ..layers.norms import rms_norm_forward
from ..memory.lean_activations import LeanActivations
from ..ops import availability
from ..report_text import format_report

LOG = logging.getLogger("axolotl_fastqwen")
STATE_ATTR = "_fastqwen_patch"


@dataclass
class LayerPatch:
    """What a patched module needs at call time (stored on the module as `_fastqwen`)."""

    family: FamilyPlan
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
    context: ForwardContext | None = field(default=None, repr=False)
    model: weakref.ref | None = field(default=None, repr=False)  # read live: who runs the experts
    experts_check: object | None = None  # kernels.experts_check.ExpertsCheck, set at the first GPU forward
    lean: LeanActivations | None = field(default=None, repr=False)  # fastqwen_lean_activations, when on
    rms_norms: int = 0  # transformers RMSNorm modules of the decoder run by the rms_norm op
    moe_blocks: int = 0  # sparse MoE blocks whose shared expert is added in the routed sum (layers/moe_block.py)
    mlps: int = 0  # dense SwiGLU MLPs (MoE: shared experts) whose SiLU-multiply the swiglu op runs (layers/mlp.py)
    mlps_off: str = ("no SiLU MLP of the family's own class and forward in the decoder: another integration's, e.g. "
                     "liger_glu_activation's or lora_mlp_kernel's, runs")  # why, where `mlps` is 0
    fp8: Fp8Weights | None = field(default=None, repr=False)  # fastqwen_fp8, when on
    mlp_chunks: MlpChunks | None = field(default=None, repr=False)  # fastqwen_mlp_chunk_tokens, when set
    offload: CheckpointOffload | None = field(default=None, repr=False)  # fastqwen_checkpoint_offload, when on
    moe_graphs: MoeCudaGraphs | None = field(default=None, repr=False)  # fastqwen_moe_cuda_graphs, when on
    fused_lora: FusedLora | None = field(default=None, repr=False)  # peft LoRA linears as one function, when on

    def backends(self) -> dict[str, str]:
        names = self.kernels.names()
        # Not patched ("off (...)", "delegated to ..."): say so. Patched: the live choice, which the
        # first-forward self-check may have demoted since patch time.
        if self.fused_cross_entropy.startswith(("off", "delegated")):
            names["linear_cross_entropy"] = self.fused_cross_entropy
        if not self.attention_layers:
            names.pop("varlen_attention", None)
        if not self.rms_norms:
            names["rms_norm"] = ("off (no RMSNorm of the family's own class in the decoder: another integration's, "
                                 "e.g. liger_rms_norm's, run)")
        if not self.mlps:
            names["swiglu"] = f"off ({self.mlps_off})"
        return names

    def to_dict(self) -> dict:
        model = self.model() if self.model is not None else None
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
            "rms_norms_patched": self.rms_norms,
            "mlps_patched": self.mlps,
            "selfchecked": self.kernels.checked and self.kernels.device.type == "cuda",
            "ops": ops,
            "experts": self._experts(model),
            "notes": list(self.kernels.notes),
            "boundary_sources": sorted(self.boundary_sources),
            "forwards_without_trainable_tokens": self.context.empty_forwards() if self.context else 0,
            "batch_shapes": {k: sorted(list(s) for s in v) for k, v in self.batch_shapes.items()},
            "lean_activations": self.lean.to_dict() if self.lean is not None else None,
            "fp8": self.fp8.to_dict() if self.fp8 is not None else None,
            "mlp_chunks": self.mlp_chunks.to_dict() if self.mlp_chunks is not None else None,
            "checkpoint_offload": self.offload.to_dict() if self.offload is not None else None,
            "moe_cuda_graphs": self.moe_graphs.to_dict() if self.moe_graphs is not None else None,
            "fused_lora": self.fused_lora.to_dict() if self.fused_lora is not None else None,
            "versions": self.versions,
        }

    def _experts(self, model) -> dict | None:
        experts = describe_experts(model) if model is not None else None
        if experts is not None:
            check = self.experts_check
            experts["selfcheck"] = check.selfcheck if check is not None else (
                "not self-checked (CPU)" if self.kernels.device.type != "cuda" else "not yet run (first forward)")
            experts["rejected"] = check.to_dict()["rejected"] if check is not None else []
            if experts["implementation"] == grouped_experts.GROUPED:
                experts["routed_rows"] = grouped_experts.describe_routed_kernels(experts_modules(model)[0])
                if "stacks" in experts:
                    experts["stacks"] += ("; each dequantized for its grouped GEMM, in the forward and again in the "
                                          "backward, none kept (layers/quantized_stacks.py)")
            elif experts["implementation"] == grouped_experts.REPLACES:  # where the plugin would have run its own
                why = next(filter(None, map(grouped_experts.unsupported, experts_modules(model))), None)
                if why is not None:
                    experts["not_grouped"] = (f"not {grouped_experts.GROUPED}: {why}; transformers' "
                                              f"{grouped_experts.REPLACES} runs them")
            experts["shared_expert"] = (
                f"its gated output added in the routed rows' sum ({self.moe_blocks} sparse blocks, layers/moe_block.py)"
                if self.moe_blocks and experts["implementation"] == grouped_experts.GROUPED else
                "transformers' block forward" + ("" if self.moe_blocks else
                                                 " (no sparse block of transformers' own forward was found)"))
        return experts

    def format(self) -> str:
        return format_report(self.to_dict())


def patch_model(
    model: nn.Module,
    *,
    backend: str = "auto",
    fused_cross_entropy: bool = True,
    device: torch.device | str | None = None,
    prefer: dict[str, str] | None = None,
    lean_activations: bool = False,
    fp8: bool = False,
    fp8_tokens: int = 8192,
    fp8_keep_transposed: bool = False,
    fp8_input_gradient: str = "fp8",
    mlp_chunk_tokens: int | None = None,
    checkpoint_offload: bool | str = False,
    fused_lora: bool = True,
    swiglu_mlps: bool = True,
    moe_cuda_graphs: bool | str = False,
    log: bool = True,
) -> PatchReport:
    """Replace the Qwen hybrid layers of `model` with the fused, boundary-correct ones.

    backend: "auto" (fastest kernels available, self-checked on the GPU, warn on any fallback),
    "require" (raise if any op would use the PyTorch path) or "reference" (PyTorch everywhere).
    device: where the model will train; defaults to the device of its parameters.
    prefer: op -> backend name to try first, e.g. {"causal_conv": "fla-triton"}.
    lean_activations: in layers that keep their activations, drop the norm, output-gate and MLP-product outputs
        autograd would hold and recompute them in backward (`memory/lean_activations.py`): same gradients,
        less memory.
    fp8: run the frozen base projections of the decoder layers on FP8 GEMMs (`patching/fp8_weights.py`):
        call it after LoRA is applied (the weights it quantizes must be frozen); each weight shape is
        self-checked and timed at `fp8_tokens` tokens on this GPU first, and kept in bf16 where FP8 does
        not win. `fp8_keep_transposed` keeps a second, transposed FP8 copy for the input gradient (1 more
        byte a parameter, 0-8% faster GEMM pairs on an H100) instead of transposing per backward: by
        default the weights take half their bf16 memory, which `fastqwen_checkpointing: auto` spends on
        kept layers. `fp8_input_gradient` says how the input gradients `dy·W` run: "fp8" (dy quantized
        per token), "fp8-1x128" (per 1x128 block, DeepSeek-V3's tiles) or "bf16" on the dequantized
        weights (FP8 forward only).
    mlp_chunk_tokens: rows of more tokens run each dense MLP in chunks of this many tokens, each
        recomputed in backward (`patching/mlp_chunks.py`): the same result without holding the MLP's
        intermediates, for one more MLP forward per layer (kept or recomputed). None: off. MoE models have no dense MLP.
    checkpoint_offload: under gradient checkpointing, the inputs of the recomputed decoder layers go to
        pinned host memory as their forward runs and come back one layer ahead in backward
        (`memory/checkpoint_offload.py`); layers whose activations are kept are untouched. "auto": only
        once a training forward's inputs would take the device past `AUTO_FRACTION` of its memory (on
        from then on).
    fused_lora: peft's LoRA linear layers add the adapter's product in its second GEMM
        (`torch.addmm`, `patching/fused_lora.py`): no full-size scale or add, autograd's native
        backward; peft's own forward wherever the layer is not the plain case.
    swiglu_mlps: the dense SwiGLU MLPs (MoE: the shared experts) compute `silu(gate) · up` with the swiglu
        op, which holds gate and up alone, and mark the product recomputable (`layers/mlp.py`); False leaves
        them stock (the benchmark's before path).
    moe_cuda_graphs: the sparse MoE blocks of layers that keep their activations replay their forward and
        backward as CUDA graphs once warm (`patching/moe_cuda_graphs.py`): the same kernels, one launch each
        way a block; every other call runs eagerly, counted with its reason in the report. "auto" (the Axolotl
        key's default): the same on MoE models that train on a CUDA device; nothing, and nothing said, elsewhere.
    log: log the report table now (the Axolotl plugin logs it itself, after adding its notes).
    Returns the report; `unpatch_model(model)` restores the stock forward exactly.
    """
    base = unwrap(model)
    if getattr(base, STATE_ATTR, None) is not None:
        return getattr(base, STATE_ATTR)["report"]
    for name, value in (("checkpoint_offload", checkpoint_offload), ("moe_cuda_graphs", moe_cuda_graphs)):
        if value not in (False, True, "auto"):
            raise ValueError(f"{name}={value!r}: False, True or 'auto'")
    plan = detect_family(base, registry.families())
    target = torch.device(device) if device is not None else model_device(base)
    kernels = select_kernels(target, backend, prefer=prefer)
    context = ForwardContext()
    patched, counts, norms, mlps = _install_layers(base, plan, kernels, context, swiglu_mlps)

    report = PatchReport(
        family=plan.name,
        model_class=type(base).__name__,
        gated_deltanet_layers=counts["gated_deltanet"],
        attention_layers=counts["attention"],
        fused_cross_entropy="off",
        kernels=kernels,
        versions=availability.versions(),
        context=context,
        model=weakref.ref(base),
        rms_norms=len(norms),
        moe_blocks=counts["moe_block"],
        mlps=len(mlps),
    )
    if not swiglu_mlps:
        report.mlps_off = "patch_model(swiglu_mlps=False): the MLPs stay stock"
    experts_before = _use_grouped_experts(base, kernels)
    lora_cast = LoraInputCast(base)
    expert_adapters = ExpertAdapters(base)
    decoder_layers = [layer for m in base.modules() if type(m) in plan.decoder for layer in m.layers]
    if checkpoint_offload:
        report.offload = CheckpointOffload(decoder_layers, auto=checkpoint_offload == "auto")
    if fused_lora:
        report.fused_lora = FusedLora(base, [m for m in base.modules() if type(m) in plan.decoder])
    hook = DecoderPreHook(report, base, lora_cast, context, expert_adapters, offload=report.offload,
                          fused_lora=report.fused_lora)
    hooks = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in base.modules() if type(m) in plan.decoder]
    if not hooks:
        raise RuntimeError(f"{type(base).__name__}: no decoder model of {plan.family.decoder} found to hook")

    if fused_cross_entropy:
        report.fused_cross_entropy = _patch_causal_lm(base, plan, kernels, patched, context)
    if lean_activations:
        report.lean = LeanActivations(decoder_layers, plan.family.layer_norms)
    if fp8:
        decoders = [m for m in base.modules() if type(m) in plan.decoder]
        report.fp8 = Fp8Weights.install(decoders, tokens=fp8_tokens, keep_transposed=fp8_keep_transposed,
                                        input_gradient=fp8_input_gradient)
    if mlp_chunk_tokens is not None and plan.family.moe:
        kernels.notes.append(f"mlp chunks: not applied: {plan.name} routes tokens to experts and has no dense MLP "
                             "(a sparse block's router outputs are recorded per call for the auxiliary loss)")
    elif mlp_chunk_tokens is not None:
        report.mlp_chunks = MlpChunks.install(decoder_layers, mlp_chunk_tokens)
    if moe_cuda_graphs is True and not plan.moe_block:
        kernels.notes.append(f"moe cuda graphs: not applied: {plan.name} has no sparse MoE block")
    elif plan.moe_block and (moe_cuda_graphs is True or moe_cuda_graphs == "auto" and target.type == "cuda"):
        report.moe_graphs = MoeCudaGraphs.install(decoder_layers, plan.moe_block)
    base.__dict__[STATE_ATTR] = {"modules": patched, "hooks": hooks, "report": report, "lora_cast": lora_cast,
                                 "context": context, "expert_adapters": expert_adapters,
                                 "experts_before": experts_before}
    if log:
        LOG.info("%s", report.format())
    return report


def _install_layers(base: nn.Module, plan: FamilyPlan, kernels: KernelSet, context: ForwardContext,
                    swiglu_mlps: bool = True):
    """The fused forwards on every Gated DeltaNet, attention, RMSNorm and SwiGLU MLP module of the decoder:
    (patched modules, layer counts by kind, the norms among them, the MLPs among them)."""
    layers = {cls: (gated_deltanet_forward, "gated_deltanet") for cls in plan.gated_deltanet}
    layers.update({cls: (attention_forward, "attention") for cls in plan.attention})
    # the sparse blocks whose forward is still transformers' own (another integration's class patch is left alone)
    layers.update({cls: (sparse_moe_block_forward, "moe_block") for cls in plan.moe_block
                   if cls.forward.__module__ == plan.module.__name__})
    patched: list[nn.Module] = []
    counts = {"gated_deltanet": 0, "attention": 0, "moe_block": 0}
    for module in base.modules():
        if type(module) not in layers:
            continue
        forward, kind = layers[type(module)]
        if kind == "moe_block" and _forward_replaced(module):  # e.g. Axolotl's LoRA MLP kernel, bound per instance
            continue
        if kind == "gated_deltanet":
            _check_conv_not_adapted(module)
        _install(module, forward, plan, kernels, context)
        patched.append(module)
        counts[kind] += 1
    # modules whose forward no other integration bound to the instance (Liger's norms, Axolotl's lora_mlp_kernel)
    free = [m for decoder in base.modules() if type(decoder) in plan.decoder
            for m in decoder.modules() if not _forward_replaced(m)]
    norms = [m for m in free if type(m) in plan.rms_norm]
    for module in norms:
        _install(module, rms_norm_forward, plan, kernels, context)
    # and, of the MLPs, those still on their class's own forward with transformers' SiLU
    mlps = [m for m in free if swiglu_mlps and type(m) in plan.mlp and runs_silu(m)
            and type(m).forward.__module__ == plan.module.__name__]
    for module in mlps:
        _install(module, swiglu_mlp_forward, plan, kernels, context)
    return patched + norms + mlps, counts, norms, mlps


def unpatch_model(model: nn.Module) -> None:
    """Remove everything `patch_model` installed; the model is stock again, bit for bit."""
    base = unwrap(model)
    state = base.__dict__.pop(STATE_ATTR, None)
    if state is None:
        return
    for handle in state["hooks"]:
        handle.remove()
    state["lora_cast"].restore()
    if state["report"].fused_lora is not None:
        state["report"].fused_lora.restore()
    state["expert_adapters"].restore()
    if state["report"].lean is not None:
        state["report"].lean.restore()
    if state["report"].fp8 is not None:
        state["report"].fp8.restore()
    if state["report"].mlp_chunks is not None:
        state["report"].mlp_chunks.restore()
    if state["report"].offload is not None:
        state["report"].offload.restore()
    if state["report"].moe_graphs is not None:
        state["report"].moe_graphs.restore()
    if state["experts_before"] is not None and experts_implementation(experts_modules(base)[0]) == grouped_experts.GROUPED:
        set_experts_implementation(base, state["experts_before"])
    for module in experts_modules(base):  # routed-row kernels the experts self-check pinned
        module.__dict__.pop(grouped_experts.ROUTED_KERNELS_ATTR, None)
    for module in state["modules"]:
        _uninstall(module)
    hopper_guard.release(state["report"].kernels)  # fla's own guard value, if this model's self-check lifted it


def _use_grouped_experts(base: nn.Module, kernels: KernelSet) -> str | None:
    """MoE models that would run transformers' `grouped_mm` run `fastqwen_grouped` instead (the same
    math, see `layers/grouped_experts.py`); any other implementation the user chose (eager, ScatterMoE, ...)
    is left alone, and `backend="reference"` keeps stock experts. Returns what was replaced."""
    found = experts_modules(base)
    if kernels.mode == "reference" or not found or not all(grouped_experts.supports(m) for m in found):
        return None
    before = experts_implementation(found[0])
    if before != grouped_experts.REPLACES:
        return None
    grouped_experts.register()
    set_experts_implementation(base, grouped_experts.GROUPED)
    return before


def is_patched(model: nn.Module) -> bool:
    return STATE_ATTR in unwrap(model).__dict__


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


def _install(module: nn.Module, forward, plan: FamilyPlan, kernels: KernelSet, context: ForwardContext) -> None:
    attr = forward_attr(module)  # beneath accelerate's hooks
    original = getattr(module, attr)
    module.__dict__["_fastqwen"] = LayerPatch(plan, kernels, original, context)
    module.__dict__["_fastqwen_attr"] = attr
    module.__dict__["_fastqwen_had_instance_forward"] = attr in module.__dict__
    setattr(module, attr, PatchedForward(forward, module, inspect.signature(original)))


def _forward_replaced(module: nn.Module) -> bool:
    """Another integration bound its own forward to this instance (Liger's `_patch_rms_norm_module`
    does, given a model): leave the module to it."""
    return bound_forward(module) is not None


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


def _patch_causal_lm(base: nn.Module, plan: FamilyPlan, kernels: KernelSet, patched: list, context) -> str:
    if type(base) not in plan.causal_lm:
        return f"off ({type(base).__name__} is not one of {plan.family.causal_lms})"
    head = base.lm_head
    if type(head) is not nn.Linear or head.bias is not None:
        return f"off (lm_head is {type(head).__name__}: an adapter or bias on it needs the stock loss)"
    _install(base, causal_lm_forward, plan, kernels, context)
    patched.append(base)
    return kernels.choices["linear_cross_entropy"].backend.name


