"""Hold an MoE model's expert choices to those of an earlier run, to compare two precisions.

With routers at their initial scale, many tokens have their k-th and (k+1)-th router probabilities
within bf16 rounding of each other, so a bf16 run and an fp32 run of the same weights pick a
different expert for some of them. Each such flip moves that token's whole contribution from one
expert's weight gradient to another's: a property of the precision, not an error of any kernel,
and at 256 experts top-8 it dominates the global gradient difference (measured on the H200: 0.39
relative, with loss and auxiliary loss within 3e-4). Recording a run's top-k indices and imposing
them on the other (each run still computes its own router probabilities, in its own precision,
and renormalises them over the imposed experts exactly as transformers' router does) compares the
kernels on one routing. Routers are found by class name (`...TopKRouter`: Qwen3.5-MoE, Qwen3-Next)
and matched call by call, per module, in forward order.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict

import torch
from torch import nn


def routers(model: nn.Module) -> list[nn.Module]:
    found = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
    if not found:
        raise ValueError(f"{type(model).__name__} has no ...TopKRouter module")
    return found


@contextlib.contextmanager
def record_routing(model: nn.Module, store: dict):
    """Append each router call's top-k indices to `store[router]` (a list per router module)."""
    def hook(module, args, out):
        store.setdefault(module, []).append(out[2].detach().clone())

    handles = [r.register_forward_hook(hook) for r in routers(model)]
    try:
        yield store
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def impose_routing(model: nn.Module, recorded: dict):
    """Replace each router call's indices by the recorded ones (same call order) and its weights by
    this run's own softmax probabilities at those indices, renormalised over them."""
    calls = defaultdict(int)

    def hook(module, args, out):
        logits = out[0]
        indices = recorded[module][calls[module]].to(logits.device)
        calls[module] += 1
        probs = torch.softmax(logits, dtype=torch.float, dim=-1).gather(-1, indices)
        return logits, (probs / probs.sum(dim=-1, keepdim=True)).to(logits.dtype), indices

    handles = [r.register_forward_hook(hook) for r in routers(model)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
    unused = {m: len(v) - calls[m] for m, v in recorded.items() if len(v) != calls[m]}
    if unused:
        raise AssertionError(f"router calls did not match the recorded run: {len(unused)} routers differ in count")


def flipped_fraction(a: dict, b: dict) -> float:
    """Share of (token, router call) pairs whose top-k expert sets differ between two recordings."""
    diff = total = 0
    for module, calls in a.items():
        for x, y in zip(calls, b[module], strict=True):
            diff += int((x.sort(-1).values != y.sort(-1).values).any(-1).sum())
            total += x.shape[0]
    return diff / total
