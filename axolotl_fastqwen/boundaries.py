"""Sequence boundaries of a packed batch, resolved once per forward and shared by every layer.

A packed row holds several sequences back to back. The recurrence (fla `cu_seqlens`), the causal
conv (causal-conv1d `seq_idx`) and varlen attention (`cu_seqlens` + `max_seqlen`) each need the
boundaries in their own form. Stock transformers derives them inside every layer, with a host sync
each time; here they are resolved once, before the first layer, and passed down as one object.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

BOUNDARIES_KWARG = "fastqwen_boundaries"
HOST_CU_SEQLENS_KWARG = "fastqwen_cu_seqlens_host"


class BoundaryError(ValueError):
    """The batch's boundary tensors contradict each other: training on it would be silently wrong."""


@dataclass(eq=False)
class Boundaries:
    """Where each sequence of a flattened `[1, total]` token stream starts and ends.

    cu_seqlens: int32 `[N + 1]` on the model's device, 0 first and `total` last.
    cu_seqlens_host: int64 `[N + 1]` on the CPU: kernels that plan their grid on the host (fla's
        chunk indices) read it instead of copying `cu_seqlens` back from the GPU.
    seq_idx: int32 `[1, total]` on the device, the sequence index of every token (causal-conv1d).
    max_seqlen: length of the longest sequence (varlen attention).
    source: where the boundaries came from, for the report ("collator", "position_ids", ...).
    """

    cu_seqlens: torch.Tensor
    cu_seqlens_host: torch.Tensor
    seq_idx: torch.Tensor
    max_seqlen: int
    source: str
    _position_in_sequence: torch.Tensor | None = field(default=None, repr=False)

    @property
    def total(self) -> int:
        return int(self.cu_seqlens_host[-1])

    @property
    def num_sequences(self) -> int:
        return self.cu_seqlens_host.numel() - 1

    def lengths(self) -> list[int]:
        return self.cu_seqlens_host.diff().tolist()

    def position_in_sequence(self) -> torch.Tensor:
        """Offset of every token from the start of its sequence, long `[total]` on the device."""
        if self._position_in_sequence is None:
            starts = self.cu_seqlens.long()[self.seq_idx.view(-1).long()]
            self._position_in_sequence = torch.arange(self.total, device=starts.device) - starts
        return self._position_in_sequence

    @classmethod
    def from_cu_seqlens(
        cls,
        cu_seqlens: torch.Tensor,
        *,
        device: torch.device,
        host: torch.Tensor | tuple[int, ...] | list[int] | None = None,
        seq_idx: torch.Tensor | None = None,
        max_seqlen: int | None = None,
        source: str = "collator",
    ) -> Boundaries:
        """Boundaries from a collator's `cu_seq_lens_q` (plus, when it has them, their host copy and
        `seq_idx`). Without a host copy, one device-to-host copy is made here, once per forward."""
        if host is None:
            host_t = cu_seqlens.detach().to("cpu", torch.int64)
            source = f"{source} (host copy made on the device: 1 sync per forward)"
        else:
            host_t = torch.as_tensor(host, dtype=torch.int64).cpu()
        _check_cu_seqlens(host_t)
        if max_seqlen is None:
            max_seqlen = int(host_t.diff().max())
        cu_dev = cu_seqlens.to(device=device, dtype=torch.int32, non_blocking=True)
        if seq_idx is None:
            seq_idx_host = torch.repeat_interleave(
                torch.arange(host_t.numel() - 1, dtype=torch.int32), host_t.diff()
            )
            seq_idx = seq_idx_host.view(1, -1).to(device, non_blocking=True)
        else:
            seq_idx = seq_idx.to(device=device, dtype=torch.int32, non_blocking=True).reshape(1, -1)
        return cls(cu_dev, host_t, seq_idx, int(max_seqlen), source)

    @classmethod
    def from_position_ids(cls, position_ids: torch.Tensor, *, device: torch.device) -> Boundaries:
        """Boundaries of packed rows whose `position_ids` restart at 0 for each sequence.

        Every row start is a boundary too, so a `[B, T]` batch of packed rows flattens into one
        `[1, B*T]` stream. Costs one device-to-host copy, once per forward.
        """
        flat = position_ids.reshape(position_ids.shape[-2] if position_ids.dim() > 1 else 1, -1)
        rows, width = flat.shape
        starts = flat == 0
        starts[:, 0] = True
        host = torch.nonzero(starts.reshape(-1)).reshape(-1).to("cpu", torch.int64)
        host = torch.cat([host, torch.tensor([rows * width])])
        boundaries = cls.from_cu_seqlens(
            host.to(device=device), device=device, host=host, source="position_ids (1 sync per forward)"
        )
        return boundaries

    def check_position_ids(self, position_ids: torch.Tensor) -> None:
        """Raise if `position_ids` do not restart at 0 exactly at each boundary.

        Rotary embeddings read `position_ids` while the recurrence and the conv read the
        boundaries; if the two disagree, training is silently wrong. One host sync.
        """
        flat = position_ids.reshape(-1)
        if flat.numel() != self.total:
            raise BoundaryError(
                f"position_ids cover {flat.numel()} tokens but cu_seq_lens_q ends at {self.total}. "
                "Emit position_ids and cu_seq_lens_q from the same packed row (axolotl_fastqwen's "
                "PackedCollator does)."
            )
        expected = self.position_in_sequence().to(flat.device)
        bad = torch.nonzero(flat.long() != expected)
        if bad.numel():
            i = int(bad[0])
            raise BoundaryError(
                f"position_ids disagree with cu_seq_lens_q at token {i}: position_ids[{i}] = "
                f"{int(flat[i])}, but the token is at offset {int(expected[i])} of its sequence. "
                "Each packed sequence's position_ids must restart at 0 where cu_seq_lens_q says it "
                "starts; fix the collator, or drop cu_seq_lens_q so boundaries are derived from "
                "position_ids."
            )


def _check_cu_seqlens(host: torch.Tensor) -> None:
    if host.dim() != 1 or host.numel() < 2:
        raise BoundaryError(f"cu_seq_lens_q must be 1-D with at least 2 entries, got shape {tuple(host.shape)}")
    if int(host[0]) != 0:
        raise BoundaryError(f"cu_seq_lens_q must start at 0, got {int(host[0])}")
    if bool((host.diff() <= 0).any()):
        raise BoundaryError(
            f"cu_seq_lens_q must be strictly increasing (no empty sequences), got {host.tolist()[:16]}..."
        )
