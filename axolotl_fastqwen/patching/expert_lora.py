"""peft LoRA on the routed experts (`target_parameters`) run factored, not merged.

peft wraps an experts module targeted by `target_parameters` in one `ParamWrapper` per parameter
(nested), and each forward parametrizes the stacked weight as `W + s·B·A`: the whole expert stack
is rebuilt per call, and its gradient is the size of the stack (H200: LoRA on the 35B-A3B experts
cost the plugin 1.58x -> 1.2x over Axolotl's best, benchmarks/h200/2026-12-04c). When the experts
run `fastqwen_grouped`, the outermost wrapper's forward (per instance, found at the first forward:
adapters may come after the patch) hands the factors to `layers.experts` instead, which applies
them through the rank. Anything peft does that the factored form does not (several active
adapters, merged or disabled adapters, mixed-adapter batches) goes through peft's own forward. The
wrappers stay in the module tree: saving, loading and the optimizer see peft's parameters as before.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from ..layers.experts_implementation import EXPERT_WEIGHTS, experts_implementation, is_experts
from ..layers.forward_slot import forward_attr
from ..layers.grouped_experts import GROUPED, RANK_MULTIPLE, ExpertLora, compute_dtype, grouped_experts_forward, supports
from .lora_weight_copies import LoraWeightCopies


def _param_wrapper_class():
    try:
        from peft.tuners.lora.layer import ParamWrapper
    except ImportError:  # peft is optional outside Axolotl
        return None
    return ParamWrapper


def wrapper_chains(model: nn.Module) -> list[tuple[nn.Module, dict[str, nn.Module], nn.Module]]:
    """(outermost wrapper, {parameter name: wrapper}, experts module) for each experts module that
    peft's `target_parameters` wrapped."""
    wrapper_cls = _param_wrapper_class()
    if wrapper_cls is None:
        return []
    wrappers = [m for m in model.modules() if isinstance(m, wrapper_cls)]
    inner = {id(w.base_layer) for w in wrappers}
    chains = []
    for outer in (w for w in wrappers if id(w) not in inner):
        chain, base = {}, outer
        while isinstance(base, wrapper_cls):
            chain[base.parameter_name] = base
            base = base.base_layer
        if set(chain) <= set(EXPERT_WEIGHTS) and is_experts(base):
            chains.append((outer, chain, base))
    return chains


def _adapter(chain: dict[str, nn.Module]) -> str | None:
    """The one adapter every wrapper of the chain applies unmerged, or None (peft's forward then)."""
    names = set()
    for wrapper in chain.values():
        active = list(wrapper.active_adapters)
        if wrapper.disable_adapters or wrapper.merged or len(active) != 1 or active[0] not in wrapper.lora_A:
            return None
        names.add(active[0])
    return names.pop() if len(names) == 1 else None


def factored(wrapper: nn.Module, adapter: str, dtype: torch.dtype, copies=None) -> ExpertLora:
    """peft's factors of one wrapper, laid out for grouped GEMMs (peft's layout: lora_A (E·r, in)
    rows expert-major, lora_B (out, r·E) columns rank-major; see `ParamWrapper.get_delta_weight`),
    cast to the weight's dtype as peft's merge does; the rank padded with zeros to RANK_MULTIPLE.
    `copies`: `(A, s·B)` already cast for this forward (`lora_weight_copies.py`): the scaling is in B."""
    experts, rank = wrapper.num_experts, wrapper.r[adapter]
    if copies is not None:
        (a, b), scaling = copies, 1.0
    else:
        a, b = wrapper.lora_A[adapter].weight.to(dtype), wrapper.lora_B[adapter].weight.to(dtype)
        scaling = float(wrapper.scaling[adapter])
    a = a.view(experts, rank, a.shape[-1]).transpose(1, 2)  # (E, in, r)
    b = b.view(b.shape[0], rank, experts).permute(2, 1, 0).contiguous()  # (E, r, out)
    pad = -rank % RANK_MULTIPLE
    if pad:
        a, b = F.pad(a, (0, pad)), F.pad(b, (0, 0, 0, pad))
    return ExpertLora(a, b, scaling)


class FactoredExpertsForward:
    """The outermost wrapper's instance forward: factored when it can be, peft's otherwise."""

    def __init__(self, outer: nn.Module, chain: dict[str, nn.Module], experts: nn.Module, attr: str = "forward",
                 copies: LoraWeightCopies | None = None):
        self.outer, self.chain, self.experts, self.attr = outer, chain, experts, attr
        self.copies = copies if copies is not None else LoraWeightCopies(needs_autocast=False)
        # an instance forward there before (accelerate's `_old_forward`), else None: the class's forward,
        # looked up per call (peft's, or what an integration patched into the class: Axolotl's ScatterMoE)
        self.original = outer.__dict__.get(attr)
        self.calls = 0  # forwards that ran factored (the report and the tests read it)

    def _factored_adapter(self, kwargs: dict) -> str | None:
        """The adapter to run factored for a call with `kwargs`, or None (peft's forward then)."""
        adapter = None if kwargs.get("adapter_names") is not None else _adapter(self.chain)
        if (adapter is None or experts_implementation(self.experts) != GROUPED or not supports(self.experts)
                or any(w.num_experts <= 1 for w in self.chain.values())):
            return None
        return adapter

    def takes_shared_expert(self) -> bool:
        """A plain call runs factored, in `grouped_experts_forward`, which adds the sparse block's shared
        expert in its sum (`layers/moe_block.py` asks)."""
        return self._factored_adapter({}) is not None

    def __call__(self, x, *args, **kwargs):
        adapter = self._factored_adapter(kwargs)
        if adapter is None:
            original = self.original or type(self.outer).forward.__get__(self.outer)
            shared = kwargs.pop("shared_expert", None)
            out = original(x, *args, **kwargs)
            # transformers' block's own term, should the adapters change between its question and this call
            return out if shared is None else out + torch.sigmoid(shared.gate) * shared.output
        kwargs.pop("adapter_names", None)
        dtype = compute_dtype(self.experts)
        lora = {name: factored(wrapper, adapter, dtype, self.copies.get(
                    wrapper, adapter, dtype, wrapper.lora_A[adapter].weight, wrapper.lora_B[adapter].weight))
                for name, wrapper in self.chain.items()}
        self.calls += 1
        return grouped_experts_forward(self.experts, x, *args, lora=lora, **kwargs)

    def __deepcopy__(self, memo):  # like a bound method: a deep copy of the model binds to the copies
        copied = copy.copy(self)
        copied.outer, copied.experts = copy.deepcopy(self.outer, memo), copy.deepcopy(self.experts, memo)
        copied.chain = {name: copy.deepcopy(w, memo) for name, w in self.chain.items()}
        copied.original = copy.deepcopy(self.original, memo)
        return copied


class ExpertAdapters:
    """Installs `FactoredExpertsForward` on every wrapped experts module at the first forward;
    `restore` takes them off."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.installed: list[FactoredExpertsForward] | None = None
        self.copies = LoraWeightCopies(needs_autocast=False)  # the factors cast once a forward

    def update(self, device_type: str | None = None) -> None:
        if self.installed is None:
            self.installed = []
            for outer, chain, experts in wrapper_chains(self.model):
                attr = forward_attr(outer)  # beneath accelerate's dispatch hook
                forward = FactoredExpertsForward(outer, chain, experts, attr, self.copies)
                setattr(outer, attr, forward)
                self.installed.append(forward)
        if device_type is not None and self.installed:
            entries = []
            for forward in self.installed:
                adapter = forward._factored_adapter({})
                if adapter is not None:
                    dtype = compute_dtype(forward.experts)
                    entries += [(w, adapter, w.lora_A[adapter].weight, w.lora_B[adapter].weight, w.scaling[adapter],
                                 dtype) for w in forward.chain.values()]
            self.copies.refresh(entries, device_type)

    def restore(self) -> None:
        for forward in self.installed or []:
            if forward.outer.__dict__.get(forward.attr) is forward:
                if forward.original is None:
                    delattr(forward.outer, forward.attr)
                else:
                    setattr(forward.outer, forward.attr, forward.original)
        self.installed = None
        self.copies = LoraWeightCopies(needs_autocast=False)

    def describe(self) -> str | None:
        """For the report, once a forward ran factored."""
        if not self.installed or not any(f.calls for f in self.installed):
            return None
        params = sorted({name for f in self.installed for name in f.chain})
        cast = ("; its factors cast to the experts' dtype once a forward, s·B folded (lora_weight_copies.py)"
                if self.copies.state == "on" else "")
        return (f"peft LoRA on {len(self.installed)} experts modules ({', '.join(params)}) runs factored through "
                f"the rank in {GROUPED} (no merged expert stack per forward, no stack-sized gradient){cast}")
