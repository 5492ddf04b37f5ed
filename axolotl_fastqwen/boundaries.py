"""Sequence boundaries of a packed batch, resolved once per forward and shared by every layer.

A packed row holds several sequences back to back. The recurrence (fla `cu_seqlens`), the causal
conv (causal-conv1d `seq_idx`) and varlen attention (`cu_seqlens` + `max_seqlen`) each need the
boundaries in their own form. Stock transformers derives them inside every layer, with a host sync
each time; here they are resolved once, before the first layer, and passed down as one object.

`resolve(...)` reads them from whatever layout the batch has: our collator's `cu_seq_lens_q` (plus
its host copy), Axolotl's multipack rows (an `attention_mask` of per-sequence ids 1, 2, 3, ... and
0 for padding, with restarting `position_ids`), or bare `position_ids` that restart. A batch that
is not packed (padding marked by a 0/1 mask, positions that never restart inside a sequence)
resolves to None and runs as stock does. A layout that contradicts itself raises `BoundaryError`:
never a silent leak between sequences.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

BOUNDARIES_KWARG = "fastqwen_boundaries"
HOST_CU_SEQLENS_KWARG = "fastqwen_cu_seqlens_host"
PADDING_SEGMENTS_KWARG = "fastqwen_padding_segments"  # a collator row's segments that hold no data (host tuple)


# what transformers calls the cache argument of the decoder and its layers (5.24 renamed both to `cache`)
CACHE_KWARGS = ("past_key_values", "cache_params", "cache")


def cache_of(kwargs: dict):
    """The cache a forward was given, under whichever name this transformers uses (or None)."""
    return next((kwargs[k] for k in CACHE_KWARGS if kwargs.get(k) is not None), None)


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
    padding_segments: indices of the segments that are padding, not data (the router's auxiliary
        loss of MoE models counts real tokens only).
    """

    cu_seqlens: torch.Tensor
    cu_seqlens_host: torch.Tensor
    seq_idx: torch.Tensor
    max_seqlen: int
    source: str
    padding_segments: tuple[int, ...] = ()
    _position_in_sequence: torch.Tensor | None = field(default=None, repr=False)
    _cu_seqlens_int64: torch.Tensor | None = field(default=None, repr=False)

    @property
    def total(self) -> int:
        return int(self.cu_seqlens_host[-1])

    @property
    def num_sequences(self) -> int:
        return self.cu_seqlens_host.numel() - 1

    def lengths(self) -> list[int]:
        return self.cu_seqlens_host.diff().tolist()

    def window(self, first: int, end: int) -> Boundaries:
        """Sequences `first` to `end - 1` alone: the boundaries of their tokens
        `cu_seqlens_host[first]:cu_seqlens_host[end]` (device tensors sliced, no sync)."""
        host = self.cu_seqlens_host[first:end + 1] - self.cu_seqlens_host[first]
        start, stop = int(self.cu_seqlens_host[first]), int(self.cu_seqlens_host[end])
        return Boundaries(self.cu_seqlens[first:end + 1] - self.cu_seqlens[first], host,
                          self.seq_idx[:, start:stop] - first, int(host.diff().max()), self.source,
                          tuple(i - first for i in self.padding_segments if first <= i < end))

    def cu_seqlens_int64(self) -> torch.Tensor:
        """`cu_seqlens` as int64 on the device, cast once per batch (one tensor object for all layers)."""
        if self._cu_seqlens_int64 is None:
            self._cu_seqlens_int64 = self.cu_seqlens.long()
        return self._cu_seqlens_int64

    def fla_varlen(self) -> dict[str, torch.Tensor]:
        """fla's varlen arguments, the same tensor objects for every layer of the forward.

        fla caches its chunk plan (`prepare_chunk_indices`, built on the host from `cu_seqlens_cpu`
        and copied to the GPU with a blocking copy) by the identity of the tensors passed. A fresh
        int64 cast per layer missed that cache in every conv and GDN call: on the H200 two host
        syncs per GDN layer and forward (tools/gpu/moe_sync_trace.py). One cast per batch hits it.
        """
        return {"cu_seqlens": self.cu_seqlens_int64(), "cu_seqlens_cpu": self.cu_seqlens_host}

    def position_in_sequence(self) -> torch.Tensor:
        """Offset of every token from the start of its sequence, long `[total]` on the device."""
        if self._position_in_sequence is None:
            starts = self.cu_seqlens_int64()[self.seq_idx.view(-1).long()]
            self._position_in_sequence = torch.arange(self.total, device=starts.device) - starts
        return self._position_in_sequence

    def real_token_mask(self) -> torch.Tensor | None:
        """1 for data tokens, 0 for padding, long `[1, total]` on the device; None without padding."""
        if not self.padding_segments:
            return None
        keep = torch.ones(self.num_sequences, dtype=torch.long)
        keep[list(self.padding_segments)] = 0
        per_token = torch.repeat_interleave(keep, self.cu_seqlens_host.diff())
        return per_token.view(1, -1).to(self.seq_idx.device, non_blocking=True)

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
        padding_segments: tuple[int, ...] = (),
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
        return cls(cu_dev, host_t, seq_idx, int(max_seqlen), source, tuple(padding_segments))

    @classmethod
    def from_starts(cls, starts: torch.Tensor, total: int, *, device: torch.device, source: str,
                    padding_segments: tuple[int, ...] = ()) -> Boundaries:
        """Boundaries from the host indices where sequences start (0 included)."""
        host = torch.cat([starts.to("cpu", torch.int64), torch.tensor([total])])
        return cls.from_cu_seqlens(host.to(device), device=device, host=host, source=source,
                                   padding_segments=padding_segments)

    @classmethod
    def from_position_ids(cls, position_ids: torch.Tensor, *, device: torch.device) -> Boundaries:
        """Boundaries of packed rows: a sequence starts at every row start and wherever a position
        does not follow its predecessor by one. Costs one device-to-host copy."""
        flat = _rows(position_ids).to("cpu")
        starts = _row_starts(flat) | _restarts(flat)
        return cls.from_starts(torch.nonzero(starts.reshape(-1)).reshape(-1), flat.numel(), device=device,
                               source="position_ids (1 sync per forward)")

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


def resolve(
    *,
    device: torch.device,
    position_ids: torch.Tensor | None,
    attention_mask=None,
    cu_seq_lens_q: torch.Tensor | None = None,
    host_cu_seqlens=None,
    seq_idx: torch.Tensor | None = None,
    max_length_q: int | None = None,
    padding_segments=None,
    validate: bool = True,
    input_width: int | None = None,
) -> tuple[Boundaries | None, str | None]:
    """The boundaries of one batch, or None when it is not packed (stock semantics apply), and a
    note for the report when the batch is one the recurrence can only read as stock does.

    `position_ids` are the text positions `[B, T]` (the first MRoPE axis for 3-D ones);
    `input_width` is T (a generation mask that also covers the cache is wider: not packed).
    `validate`: cross-check a collator's boundary tensors against its `position_ids` and mask (one
    host sync; the caller decides how often that is worth it on a GPU).
    """
    if cu_seq_lens_q is not None:
        return _from_collator(device, position_ids, attention_mask, cu_seq_lens_q, host_cu_seqlens, seq_idx,
                              max_length_q, padding_segments, validate), None
    if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2:
        if input_width is not None and attention_mask.shape[-1] != input_width:
            return None, None  # generation: the mask spans the cache and the new tokens
        return _from_mask(device, attention_mask, position_ids), None
    if position_ids is None:
        return None, None
    flat = _rows(position_ids).to("cpu")
    restarts = _restarts(flat)
    if not bool(restarts.any()):
        return None, None  # every row is one sequence, whatever its first position: stock semantics
    starts = torch.nonzero((_row_starts(flat) | restarts).reshape(-1)).reshape(-1)
    if attention_mask is None:
        return Boundaries.from_starts(starts, flat.numel(), device=device,
                                      source="position_ids (1 sync per forward)"), None
    boundaries = Boundaries.from_starts(starts, flat.numel(), device=device,
                                        source="position_ids + a block-diagonal 4-D mask (2 syncs per forward)")
    if _is_block_causal(attention_mask, boundaries, flat.shape):
        return boundaries, None
    return None, (
        f"position_ids restart inside a row, with an attention_mask ({_describe(attention_mask)}) that is not "
        "the block-diagonal causal mask of those restarts (a shared-prefix or tree mask?): attention follows the "
        "mask, and the Gated DeltaNet layers read each row as one sequence, as stock transformers does (a "
        "recurrence cannot follow an arbitrary mask)"
    )


def _is_block_causal(mask, boundaries: Boundaries, shape) -> bool:
    """Whether a 4-D mask `[B|1, 1|H, T, T]` allows exactly each token's own sequence, causally."""
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4 or not mask.shape[-1] == mask.shape[-2] == shape[-1]:
        return False
    rows, width = shape
    allowed = mask.detach().to("cpu")
    allowed = allowed if allowed.dtype == torch.bool else allowed > torch.finfo(allowed.dtype).min / 2
    seq = torch.repeat_interleave(torch.arange(boundaries.num_sequences), boundaries.cu_seqlens_host.diff())
    seq = seq.view(rows, width)
    want = (seq[:, :, None] == seq[:, None, :]) & torch.ones(width, width, dtype=torch.bool).tril()
    return bool((allowed == want[:, None]).all())


def _from_collator(device, positions, mask, cu, host, seq_idx, max_length, padding, validate) -> Boundaries:
    padding = tuple(int(i) for i in (padding or ()))
    boundaries = Boundaries.from_cu_seqlens(cu, device=device, host=host, seq_idx=seq_idx, max_seqlen=max_length,
                                            padding_segments=padding)
    if padding and not 0 <= min(padding) <= max(padding) < boundaries.num_sequences:
        raise BoundaryError(
            f"{PADDING_SEGMENTS_KWARG} = {padding} names segments outside the row's "
            f"{boundaries.num_sequences}; emit both from the same row (PackedCollator does)."
        )
    if not validate:
        return boundaries
    if isinstance(mask, torch.Tensor) and not bool((mask.reshape(-1) != 0).all()):
        raise BoundaryError(
            "a packed batch (cu_seq_lens_q) also carries an attention_mask with zeros; packed rows mark "
            "padding as its own sequence and need no mask. Drop attention_mask from the collator output."
        )
    if positions is not None:
        boundaries.check_position_ids(positions)
    return boundaries


def _from_mask(device, mask: torch.Tensor, positions: torch.Tensor | None) -> Boundaries | None:
    """Axolotl's multipack rows (`attention_mask` 1, 1, 2, 2, 2, 0: a sequence id per token, 0 for
    padding), or a 0/1 mask over rows whose `position_ids` restart inside a run of ones. Anything
    else (left or right padding) is an ordinary padded batch: None."""
    m = mask.detach().to("cpu")
    if m.is_floating_point():
        if not bool((m == m.round()).all()):
            raise BoundaryError(f"attention_mask holds non-integer values ({_describe(mask)}); expected 0/1 or "
                                "per-sequence ids")
        m = m.long()
    m = m.long()
    if bool((m < 0).any()):
        raise BoundaryError(f"attention_mask holds negative values ({_describe(mask)}); expected 0/1 or "
                            "per-sequence ids 1, 2, 3, ... with 0 for padding")
    flat_m = m.reshape(-1)
    rows, width = m.shape
    row_start = torch.zeros(rows * width, dtype=torch.bool)
    row_start[::width] = True
    changes = row_start.clone()
    changes[1:] |= flat_m[1:] != flat_m[:-1]
    restarts = torch.zeros_like(row_start)
    if positions is not None:
        p = _rows(positions).to("cpu")
        if p.shape != m.shape:
            raise BoundaryError(f"position_ids have shape {tuple(p.shape)} but attention_mask {tuple(m.shape)}")
        restarts = _restarts(p).reshape(-1)
    inside_data = restarts & ~changes & (flat_m != 0)
    if int(m.max()) <= 1 and not bool(inside_data.any()):
        return None  # an ordinary padded batch
    starts = torch.nonzero(changes | (restarts & (flat_m != 0))).reshape(-1)
    padding = tuple(torch.nonzero(flat_m[starts] == 0).reshape(-1).tolist())
    source = "attention_mask ids (Axolotl multipack)" if int(m.max()) > 1 else "attention_mask + restarting position_ids"
    return Boundaries.from_starts(starts, rows * width, device=device, source=f"{source}, 1 sync per forward",
                                  padding_segments=padding)


def _rows(position_ids: torch.Tensor) -> torch.Tensor:
    """Text position ids as `[rows, T]`."""
    return position_ids.reshape(-1, position_ids.shape[-1]) if position_ids.dim() > 1 else position_ids.view(1, -1)


def _row_starts(flat: torch.Tensor) -> torch.Tensor:
    starts = torch.zeros(flat.shape, dtype=torch.bool)
    starts[:, 0] = True
    return starts


def _restarts(flat: torch.Tensor) -> torch.Tensor:
    """True where a position does not follow the one before it in its row by exactly one."""
    out = torch.zeros(flat.shape, dtype=torch.bool)
    out[:, 1:] = flat[:, 1:] != flat[:, :-1] + 1
    return out


def _describe(mask) -> str:
    if isinstance(mask, torch.Tensor):
        return f"a {mask.dim()}-D {str(mask.dtype).replace('torch.', '')} tensor of shape {tuple(mask.shape)}"
    return type(mask).__name__


def _check_cu_seqlens(host: torch.Tensor) -> None:
    if host.dim() != 1 or host.numel() < 2:
        raise BoundaryError(f"cu_seq_lens_q must be 1-D with at least 2 entries, got shape {tuple(host.shape)}")
    if int(host[0]) != 0:
        raise BoundaryError(f"cu_seq_lens_q must start at 0, got {int(host[0])}")
    if bool((host.diff() <= 0).any()):
        raise BoundaryError(
            f"cu_seq_lens_q must be strictly increasing (no empty sequences), got {host.tolist()[:16]}..."
        )
