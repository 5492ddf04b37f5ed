"""`fastqwen_fp8`: the frozen base projections of the decoder quantized once, their GEMMs on FP8.

Which modules: every plain `nn.Linear` inside the decoder layers whose weight is frozen (a LoRA
base, or a projection LoRA does not target), not an adapter's own matrix, with both dimensions
multiples of 16 and at least `MIN_FEATURES` (below that FP8 loses: k/v with 1024 outputs, the
Gated DeltaNet's 48-wide a/b, routers, the shared-expert gate). Of those, each weight shape is
then timed and self-checked on this GPU (`kernel_choice/fp8_decision.py`); lm_head and the loss,
norms, the GDN / conv / attention kernels and LoRA's A/B stay as they are.

How a module is changed, and given back: its `weight` Parameter becomes the e4m3 tensor (frozen,
so no optimizer sees it; it moves with `.to(device)`), its per-channel scales (and, when kept, the
transposed copy) are non-persistent buffers, and an instance-level `forward` runs
`ops/fp8_linear.fp8_linear`. The bf16 weight is copied to host memory first, so `restore()`
puts back the very same bits and the GPU holds 1 byte a parameter instead of 2 (plus 1 with the
transposed copy). A later cast of the module (`.to(torch.bfloat16)`) would turn the e4m3 values
into meaningless bf16 ones: the forward checks the dtype and raises instead.

The routed experts' frozen stacks (`gate_up_proj`, `down_proj`: `[E, N, K]`) of MoE models go the
same way when they run the plugin's `fastqwen_grouped` (`layers/grouped_experts.py`, which reads
the module's `Fp8Experts`): each stack is decided at its own shape over the row's routed rows, its
Parameter becomes the e4m3 stack with its scales in buffers, and `restore()` puts the bf16 stack back
from the host. Stacks run by anything else (ScatterMoE, eager, transformers' `grouped_mm`), or stored
transposed, stay bf16 and the report says why.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ..kernel_choice.fp8_decision import ShapeDecision, decide
from ..layers import grouped_experts
from ..layers.experts_implementation import EXPERT_WEIGHTS, experts_implementation, is_experts
from ..layers.quantized_stacks import stack_meta
from ..ops import fp8_grouped
from ..ops.fp8_grouped import Fp8ExpertWeight
from ..ops.fp8_linear import INPUT_GRADIENTS, MIN_CAPABILITY, Fp8Weight, InputCache, fp8_linear
from ..ops.fp8_quantize import ALIGN, E4M3
from .instance_forward import replace_forward, restore_forward

MIN_FEATURES = 1024
SCALE, TRANSPOSED = "fastqwen_fp8_scale", "fastqwen_fp8_transposed"
KEY = "_fastqwen_fp8"  # where `replace_forward` keeps the projection's own forward


class Fp8Unavailable(RuntimeError):
    """FP8 GEMMs cannot run here (no `torch._scaled_mm` with row-wise scales on this device)."""


def candidates(decoders: list[nn.Module]) -> dict[str, nn.Linear]:
    """Qualified name (within a decoder's layers) -> frozen projection that may run in FP8."""
    found = {}
    for decoder in decoders:
        for index, layer in enumerate(decoder.layers):
            for name, module in layer.named_modules():
                if type(module) is not nn.Linear or "lora_" in name or module.weight.requires_grad:
                    continue
                n, k = module.weight.shape
                if min(n, k) >= MIN_FEATURES and n % ALIGN == 0 and k % ALIGN == 0:
                    found[f"layers.{index}.{name}"] = module
    return found


def expert_candidates(decoders: list[nn.Module]) -> tuple[dict[str, tuple[nn.Module, str]], dict[str, str]]:
    """({qualified stack name: (experts module, stack name)} that may run in FP8, {report row: why
    not} for the routed experts' stacks that may not)."""
    found, refused = {}, {}
    for decoder in decoders:
        for index, layer in enumerate(decoder.layers):
            for path, module in layer.named_modules():
                if not is_experts(module):
                    continue
                implementation = experts_implementation(module)
                why = None
                if implementation != grouped_experts.GROUPED or not grouped_experts.supports(module):
                    why = (f"the experts run {implementation!r}, not the plugin's {grouped_experts.GROUPED} "
                           "(only its grouped GEMMs have an FP8 path)")
                elif any(stack_meta(module, name).quantization for name in EXPERT_WEIGHTS):
                    why = (f"stored as {stack_meta(module, 'gate_up_proj').quantization} (quantize_moe_experts): FP8 "
                           "would re-quantize quantized values")
                elif getattr(module, "is_transposed", False):
                    why = "the stacks are stored transposed ([E, in, out]); FP8 takes [E, out, in]"
                for name in EXPERT_WEIGHTS:
                    qualified = f"layers.{index}.{path}.{name}"
                    if why is not None:
                        refused.setdefault(_role(qualified), why)
                        continue
                    stack = getattr(module, name)
                    reason = "trainable (not a frozen base)" if stack.requires_grad else None
                    if reason is None and (stack.shape[1] % ALIGN or stack.shape[2] % ALIGN):
                        reason = f"{tuple(stack.shape)}: FP8 grouped GEMMs need multiples of {ALIGN}"
                    if reason is None:
                        found[qualified] = (module, name)
                    else:
                        refused.setdefault(_role(qualified), reason)
    return found, refused


def _role(qualified: str) -> str:
    """`layers.3.mlp.gate_proj.base_layer` -> `mlp.gate_proj` (the report's row)."""
    parts = qualified.split(".")[2:]
    return ".".join(p for p in parts if p != "base_layer")


@dataclass
class Fp8Weights:
    """The quantized projections of one model, and how to give them back."""

    modules: dict[str, nn.Linear] = field(default_factory=dict)
    stacks: dict[str, tuple[nn.Module, str]] = field(default_factory=dict)  # routed experts' stacks in FP8
    host: dict[str, torch.Tensor] = field(default_factory=dict)  # the bf16 weights, bit for bit
    decisions: dict[tuple[int, ...], ShapeDecision] = field(default_factory=dict)
    roles: dict[str, tuple[int, ...]] = field(default_factory=dict)  # report row -> shape
    experts_refused: dict[str, str] = field(default_factory=dict)  # report row -> why its stacks stay bf16
    tokens: int = 0
    input_gradient: str = "fp8"
    bf16_bytes: int = 0
    fp8_bytes: int = 0
    cache: InputCache = field(default_factory=InputCache)

    @classmethod
    def install(cls, decoders: list[nn.Module], *, tokens: int, keep_transposed: bool = False,
                input_gradient: str = "fp8") -> Fp8Weights:
        if input_gradient not in INPUT_GRADIENTS:
            raise ValueError(f"fp8 input_gradient={input_gradient!r}: one of {INPUT_GRADIENTS}")
        found = candidates(decoders)
        stacks, refused = expert_candidates(decoders)
        if not found and not stacks:
            raise ValueError("fastqwen_fp8: no frozen projection of at least "
                             f"{MIN_FEATURES} features in the decoder layers (is the base frozen, i.e. LoRA applied?)")
        weights = [m.weight for m in found.values()] + [getattr(m, n) for m, n in stacks.values()]
        _check_device(weights[0].device)
        samples = {}
        for weight in weights:
            samples.setdefault(tuple(weight.shape), weight)
        self = cls(tokens=tokens, input_gradient=input_gradient, experts_refused=refused)
        dense = {shape: w for shape, w in samples.items() if len(shape) == 2}
        self.decisions = decide(dense, tokens, keep_transposed, weights[0].dtype, input_gradient)
        if stacks:
            module = next(iter(stacks.values()))[0]
            top_k = int(getattr(module.config, "num_experts_per_tok", 1))
            stacked = {shape: w for shape, w in samples.items() if len(shape) == 3}
            self.decisions.update(decide(stacked, tokens, keep_transposed, weights[0].dtype,
                                         self.experts_input_gradient, rows_per_token=top_k))
        for name, module in found.items():
            shape = tuple(module.weight.shape)
            self.roles.setdefault(_role(name), shape)
            if self.decisions[shape].fp8:
                self._quantize(name, module, self.decisions[shape].keep_transposed)
        for name, (module, stack) in stacks.items():
            shape = tuple(getattr(module, stack).shape)
            self.roles.setdefault(_role(name), shape)
            if self.decisions[shape].fp8:
                self._quantize_stack(name, module, stack, self.decisions[shape].keep_transposed)
        return self

    @property
    def experts_input_gradient(self) -> str:
        """How the stacks' `dy·Wₑ` run: as the projections' where a grouped GEMM can (torch has no
        block-scaled grouped GEMM: under "fp8-1x128" the stacks quantize dy per row)."""
        return self.input_gradient if self.input_gradient in fp8_grouped.INPUT_GRADIENTS else "fp8"

    def _swap_in(self, name: str, module: nn.Module, attr: str, fp8: Fp8Weight | Fp8ExpertWeight,
                 buffers: tuple[str, str]) -> None:
        """`module.<attr>` becomes `fp8`'s e4m3 data, its scales (and kept transposed copy) the `buffers`;
        the bf16 weight goes to the host, for `_give_back`."""
        weight = getattr(module, attr)
        self.host[name] = weight.detach().to("cpu", copy=True)
        self.bf16_bytes += weight.numel() * weight.element_size()
        self.fp8_bytes += fp8.nbytes
        setattr(module, attr, nn.Parameter(fp8.data, requires_grad=False))
        module.register_buffer(buffers[0], fp8.scale, persistent=False)
        if fp8.transposed is not None:
            module.register_buffer(buffers[1], fp8.transposed, persistent=False)

    def _give_back(self, name: str, module: nn.Module, attr: str, buffers: tuple[str, str]) -> None:
        """`_swap_in` undone: the host's bf16 weight, the same bits. The e4m3 copy's memory goes back
        before the bf16 one is allocated, whoever still holds a reference (H100, 32k rows: a restore
        that held both ran out of memory)."""
        device = getattr(module, attr).device
        for tensor in (getattr(module, attr), *(module._buffers.pop(b, None) for b in buffers)):
            if tensor is not None:
                tensor.untyped_storage().resize_(0)
        setattr(module, attr, nn.Parameter(self.host[name].to(device), requires_grad=False))

    def _quantize_stack(self, name: str, module: nn.Module, stack: str, keep_transposed: bool) -> None:
        weight = getattr(module, stack)
        state = grouped_experts.fp8_experts(module)
        names = (*state.names, stack) if state is not None else (stack,)
        module.__dict__[grouped_experts.FP8_ATTR] = grouped_experts.Fp8Experts(
            names, state.dtype if state is not None else weight.dtype, self.experts_input_gradient)
        self._swap_in(name, module, stack, Fp8ExpertWeight.quantize(weight, keep_transposed=keep_transposed),
                      grouped_experts.fp8_buffers(stack))
        self.stacks[name] = (module, stack)

    def _quantize(self, name: str, module: nn.Linear, keep_transposed: bool) -> None:
        self._swap_in(name, module, "weight", Fp8Weight.quantize(module.weight, keep_transposed=keep_transposed),
                      (SCALE, TRANSPOSED))
        replace_forward(module, KEY, lambda original: _Forward(module, name, self.cache, self.input_gradient))
        self.modules[name] = module

    def restore(self) -> None:
        """Every quantized module back to its bf16 weight (the host copy: the same bits) and stock forward."""
        for name, module in self.modules.items():
            restore_forward(module, KEY)
            self._give_back(name, module, "weight", (SCALE, TRANSPOSED))
        for name, (module, stack) in self.stacks.items():
            self._give_back(name, module, stack, grouped_experts.fp8_buffers(stack))
            module.__dict__.pop(grouped_experts.FP8_ATTR, None)
        self.modules.clear()
        self.stacks.clear()
        self.host.clear()
        self.cache.clear()

    def to_dict(self) -> dict:
        rows = {}
        for role, shape in sorted(self.roles.items()):
            decision = self.decisions[shape]
            count = sum(1 for name in (*self.modules, *self.stacks) if _role(name) == role)
            rows[role] = {"shape": list(shape), "fp8": decision.fp8, "modules": count, "why": decision.why,
                          "selfcheck_error": decision.error, "speedup": decision.to_dict()["speedup"],
                          "transposed_copy_kept": decision.keep_transposed, "bf16_ms": decision.bf16_ms,
                          "fp8_ms": decision.fp8_ms}
        for role, why in sorted(self.experts_refused.items()):
            rows.setdefault(role, {"shape": None, "fp8": False, "modules": 0, "why": why})
        return {"projections": rows, "modules_fp8": len(self.modules), "expert_stacks_fp8": len(self.stacks),
                "tokens_timed": self.tokens, "input_gradient": self.input_gradient,
                "experts_input_gradient": self.experts_input_gradient if self.stacks else None,
                "bf16_bytes_freed": self.bf16_bytes, "fp8_bytes": self.fp8_bytes,
                "gpu_bytes_saved": self.bf16_bytes - self.fp8_bytes,
                "host_bytes": sum(t.numel() * t.element_size() for t in self.host.values())}


class _Forward:
    """The instance forward of a quantized projection (keeps `nn.Linear.forward`'s one argument)."""

    def __init__(self, module: nn.Linear, name: str, cache: InputCache, input_gradient: str):
        self.module = module
        self.name = name
        self.cache = cache
        self.input_gradient = input_gradient

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        module = self.module
        weight = module.weight
        if weight.dtype != E4M3:
            raise RuntimeError(
                f"fastqwen_fp8: {self.name}'s e4m3 weight was cast to {weight.dtype} after "
                "it was quantized, which turns it into meaningless values. Cast the model before the plugin patches "
                "it, or call unpatch_model(model) first.")
        fp8 = Fp8Weight(weight, module._buffers[SCALE], module._buffers.get(TRANSPOSED))
        return fp8_linear(x, fp8, module.bias, self.cache, self.input_gradient)


def _check_device(device: torch.device) -> None:
    """`torch._scaled_mm` with row-wise scales: Hopper or newer on CUDA; PyTorch's CPU kernel otherwise."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        raise Fp8Unavailable(f"fastqwen_fp8 needs FP8 tensor cores with row-wise scaling (Hopper, sm_90, or newer); "
                             f"{name} is sm_{''.join(map(str, torch.cuda.get_device_capability(device)))}")
    if not hasattr(torch, "_scaled_mm"):
        raise Fp8Unavailable(f"fastqwen_fp8 needs torch._scaled_mm (torch {torch.__version__} has none)")
