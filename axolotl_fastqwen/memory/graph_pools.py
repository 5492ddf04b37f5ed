"""Device memory that CUDA graph pools hold and the allocator's *allocated* counters do not show.

A graph captured into a private memory pool keeps every segment its capture touched: the activations
its backward reads and the forward's transient buffers, freed inside the pool once the capture is done
but reserved for the next replay. `torch.cuda.max_memory_allocated` counts only what is allocated, so a
step's measured peak leaves out the rest of the pools, and `fastqwen_checkpointing: auto`
(`checkpoint_fitter.py`), which keeps layers up to a limit on that peak, would keep too many once blocks
are captured (an H100 ran out of memory with 13.3 GiB in pools, benchmarks/h100/2026-12-07d).

Owners of graphs (`patching/moe_cuda_graphs.py`) register what their pools hold beyond their allocated
tensors; `aside_bytes()` is the sum, which the fitter adds to every peak it reads.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

_ASIDE: list[Callable[[], int]] = []


def register(aside: Callable[[], int]) -> None:
    """Count `aside()` bytes beside the allocated ones until `unregister`."""
    _ASIDE.append(aside)


def unregister(aside: Callable[[], int]) -> None:
    if aside in _ASIDE:
        _ASIDE.remove(aside)


def aside_bytes() -> int:
    """Bytes graph pools reserve beyond their allocated tensors, over every registered owner."""
    return sum(aside() for aside in _ASIDE)


def pool_sizes(pools: list) -> tuple[int, int] | None:
    """(segment bytes, allocated bytes) of these graph pools, from one allocator snapshot; None where the
    snapshot has no pool ids. The reserved total cannot say it: a capture empties the allocator's cache."""
    wanted = {tuple(p) for p in pools}
    if not wanted:
        return 0, 0
    try:
        segments = [s for s in torch.cuda.memory_snapshot() if tuple(s["segment_pool_id"]) in wanted]
        return sum(s["total_size"] for s in segments), sum(s["allocated_size"] for s in segments)
    except (KeyError, TypeError, RuntimeError):
        return None
