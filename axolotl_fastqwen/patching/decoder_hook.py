"""The decoder's forward pre-hook: what is decided once per forward, before the first layer.

In order: the GPU self-check (first forward only), peft's LoRA input cast (`lora_input_cast.py`), its
expert LoRA run factored (`expert_lora.py`) and the fused LoRA layers' adapters cast once for the
forward (`lora_weight_copies.py`), the batch-shape record for the report, the checkpoint
offload's hold on the layers' checkpoint functions (training forwards), then the
boundaries (`boundaries.resolve`) and what follows from them: one boundaries object for every
layer, no 4-D masks (the varlen kernels need none) and no cache on a packed row (it is not a
prefix to continue: an empty cache object passed in is ignored with a warning, a filled one
refused). Unpacked and generation batches pass unchanged.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from .lora_input_cast import LoraInputCast
from ..boundaries import (
    BOUNDARIES_KWARG, CACHE_KWARGS, HOST_CU_SEQLENS_KWARG, PADDING_SEGMENTS_KWARG, BoundaryError, cache_of, resolve,
)
from .expert_lora import ExpertAdapters
from .forward_context import ForwardContext
from ..kernel_choice import CheckShapes, selfcheck
from ..kernel_choice.experts_selfcheck import selfcheck_experts

LOG = logging.getLogger("axolotl_fastqwen")


class DecoderPreHook:
    """One per patched decoder (see the module docstring); `report` is the model's `PatchReport`."""

    def __init__(self, report, base: nn.Module, lora_cast: LoraInputCast, context: ForwardContext,
                 expert_adapters: ExpertAdapters | None = None, offload=None, fused_lora=None):
        self.report = report
        self.base = base
        self.lora_cast = lora_cast
        self.expert_adapters = expert_adapters
        self.context = context
        self.offload = offload  # memory.checkpoint_offload.CheckpointOffload, when on
        self.fused_lora = fused_lora  # patching.fused_lora.FusedLora, when on
        self.validated = False

    def __call__(self, module, args, kwargs):
        self._selfcheck_once()
        self._lora_input_cast()
        host = kwargs.pop(HOST_CU_SEQLENS_KWARG, None)
        padding = kwargs.pop(PADDING_SEGMENTS_KWARG, None)
        self._record_shape(module.training, args, kwargs)
        if module.training:
            kwargs["use_cache"] = False
            if self.offload is not None:
                self._offload_decision(args, kwargs)
                self.offload.sync_layers()
        self.context.last_boundaries = kwargs.get(BOUNDARIES_KWARG)
        if self.context.last_boundaries is not None:
            return args, kwargs
        cu = kwargs.get("cu_seq_lens_q")
        if torch.compiler.is_compiling() and (cu is None or host is None):
            return args, kwargs  # under torch.compile only a collator's boundaries (no host sync) are read
        device = _input_device(args, kwargs)
        position_ids = kwargs.get("position_ids")
        text_positions = _text_positions(position_ids)
        validate = device.type != "cuda" or not self.validated  # on a GPU each check is a sync: check once
        boundaries, note = resolve(
            device=device, position_ids=text_positions, attention_mask=kwargs.get("attention_mask"),
            cu_seq_lens_q=cu, host_cu_seqlens=host, seq_idx=kwargs.get("seq_idx"),
            max_length_q=kwargs.get("max_length_q"), padding_segments=padding, validate=validate,
            input_width=_input_width(args, kwargs),
        )
        if note:
            self.report.kernels.note(note)
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
            dtype = kernel_input_dtype(self.base, kernels.device)
            selfcheck(kernels, check_shapes(self.base, dtype))
            self.report.experts_check = selfcheck_experts(self.base, dtype)  # MoE models: who runs the experts
            LOG.info("%s", self.report.format())

    def _lora_input_cast(self) -> None:
        self.lora_cast.update(self.report.kernels.device.type)
        if self.expert_adapters is not None:
            self.expert_adapters.update(self.report.kernels.device.type)
        if self.fused_lora is not None:
            self.fused_lora.update(self.report.kernels.device.type)
        fused = self.fused_lora.fused_layers(self.lora_cast.layers) if self.fused_lora is not None else 0
        for note in (self.lora_cast.describe(fused), self.expert_adapters and self.expert_adapters.describe()):
            if note and note not in self.report.kernels.notes:
                self.report.kernels.notes.append(note)

    def _offload_decision(self, args, kwargs) -> None:
        """`fastqwen_checkpoint_offload: auto`: each recomputed layer will keep a `[tokens, hidden]` input
        in the residual stream's dtype (the input embeddings'); the offload decides on that."""
        if not self.offload.auto or self.offload.active:
            return
        shape = _input_shape(args, kwargs)
        embeddings = self.base.get_input_embeddings()
        if shape is None or embeddings is None or not all(type(d) is int for d in shape):
            return
        weight = embeddings.weight
        tokens = shape[0] * (shape[1] if len(shape) > 1 else 1)
        self.offload.decide(tokens * weight.shape[-1] * weight.element_size(), _input_device(args, kwargs))

    def _record_shape(self, training: bool, args, kwargs) -> None:
        shape = _input_shape(args, kwargs)
        seen = self.report.batch_shapes["train" if training else "eval"]
        # under torch.export / dynamic shapes the dims are SymInts: not recorded (and not pinned by int())
        if shape is not None and len(seen) < 64 and all(type(d) is int for d in shape):
            seen.add(shape)

    def _no_cache_on_packed_rows(self, kwargs) -> None:
        cache = cache_of(kwargs)
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
            for key in CACHE_KWARGS:
                if key in kwargs:
                    kwargs[key] = None
        kwargs["use_cache"] = False


def _input_shape(args, kwargs) -> tuple[int, ...] | None:
    for value in (kwargs.get("input_ids"), kwargs.get("inputs_embeds"), *args):
        if isinstance(value, torch.Tensor):
            return tuple(value.shape[:2])
    return None


def _input_width(args, kwargs) -> int | None:
    shape = _input_shape(args, kwargs)
    return shape[1] if shape is not None and len(shape) > 1 else None


def _input_device(args, kwargs) -> torch.device:
    for value in (kwargs.get("input_ids"), kwargs.get("inputs_embeds"), *args):
        if isinstance(value, torch.Tensor):
            return value.device
    raise ValueError("cannot tell the batch's device: no input_ids or inputs_embeds")


def kernel_input_dtype(base: nn.Module, device: torch.device | None = None) -> torch.dtype:
    """The dtype the kernels will receive in this forward: autocast's when it is on (the projections
    in front of every kernel are matmuls), else the residual stream's (the input embeddings').

    Not a parameter of the layer: under QLoRA peft's `prepare_model_for_kbit_training` leaves the
    conv weights in fp32 while Axolotl converts norms and embeddings back to bf16 and the Trainer
    runs under bf16 autocast, so the kernels see bf16. Checking at the conv weight's fp32 (as
    before) compiled and autotuned a second, fp32 set of kernels on the H200 (minutes, before the
    first step) and rejected fla on the fp32 tolerance, for kernels that then ran in bf16.
    """
    if device is not None and torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    embeddings = base.get_input_embeddings() if hasattr(base, "get_input_embeddings") else None
    weight = getattr(embeddings, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.is_floating_point():
        return weight.dtype
    return _patched_gdn(base).conv1d.weight.dtype


def _patched_gdn(base: nn.Module) -> nn.Module:
    return next(m for m in base.modules() if hasattr(m, "_fastqwen") and hasattr(m, "A_log"))


def check_shapes(base: nn.Module, dtype: torch.dtype | None = None) -> CheckShapes:
    """The head shapes of a patched model, for the self-check, at `dtype` (default: what
    `kernel_input_dtype` says outside autocast)."""
    gdn = _patched_gdn(base)
    attn = next((m for m in base.modules() if hasattr(m, "_fastqwen") and hasattr(m, "q_norm")), None)
    mlp = next((m for m in base.modules() if hasattr(m, "_fastqwen") and hasattr(m, "up_proj")), None)
    if dtype is None:
        dtype = kernel_input_dtype(base)
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
        hidden=gdn.hidden_size,
        intermediate=getattr(mlp, "intermediate_size", 1024),
    )


def _text_positions(position_ids: torch.Tensor | None) -> torch.Tensor | None:
    """The text positions of a batch, which mark packed boundaries. 2-D: as given. 3-D, transformers'
    Qwen-VL contract: `[4, B, T]` is a packed row (row 0 the text positions, rows 1-3 mRoPE); `[3, B,
    T]` holds only mRoPE's temporal / height / width positions (an image's tokens share a temporal
    position), which say nothing of boundaries: not packed."""
    if position_ids is None or position_ids.dim() == 2:
        return position_ids
    return position_ids[0] if position_ids.dim() == 3 and position_ids.shape[0] == 4 else None
