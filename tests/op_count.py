"""Counts the aten ops a region dispatches, by name (each one a kernel launch on a GPU): the CPU tests'
proof that a change removes launches."""

from __future__ import annotations

from collections import Counter

from torch.utils._python_dispatch import TorchDispatchMode


class OpCount(TorchDispatchMode):
    """`with OpCount() as ops: ...`, then `ops.counts["_to_copy"]`."""

    def __init__(self):
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))
