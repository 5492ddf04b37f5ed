"""Static-shape 1D packing for Qwen hybrid models: plan bins, deal them to ranks, collate rows.

`plan_bins` decides which samples share a `[1, token_budget]` row; `PackedBatchSampler` yields
those bins to a DataLoader (in the order accelerate deals them to ranks); `PackedCollator` turns a
bin into a row whose boundaries (`position_ids`, `cu_seq_lens_*`, `seq_idx`) agree and whose
labels never train across a boundary; `PieceDataset` resolves truncated / split / filler items;
`packing_stats` reports the result. Nothing here imports axolotl.
"""

from .collator import FILLER_KEY, HOST_CU_SEQLENS_KEY, PackedCollator, PieceDataset
from .planner import OVERLONG_MODES, Piece, plan_bins
from .sampler import PackedBatchSampler
from .stats import PackingStats, packing_stats

__all__ = [
    "FILLER_KEY",
    "HOST_CU_SEQLENS_KEY",
    "OVERLONG_MODES",
    "PackedBatchSampler",
    "PackedCollator",
    "PackingStats",
    "Piece",
    "PieceDataset",
    "packing_stats",
    "plan_bins",
]
