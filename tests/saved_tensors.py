"""What autograd saves for backward in a region, seen through an outer saved-tensor hook: each saved
tensor's shape and storage (the tensors themselves pass through untouched). The memory tests' probe."""

from __future__ import annotations

import torch


class SavedTensors:
    """`with SavedTensors() as saved: ...`, then `saved.shapes` (in order) and `saved.storages`."""

    def __init__(self):
        self.shapes: list[tuple[int, ...]] = []
        self.storages: set[int] = set()

    def __enter__(self):
        def pack(t):
            self.shapes.append(tuple(t.shape))
            self.storages.add(t.untyped_storage().data_ptr())
            return t

        self._hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
