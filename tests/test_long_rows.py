"""Long rows (issue 37): the packer, the Gated DeltaNet recurrence and the whole patched model at
the largest sizes a CPU test affords, against independent references.

- The packer at a 262,144-token budget (Qwen3.5's native context): offsets, positions and
  sequence ids of single-sequence rows, of a row of many long sequences, and of a sample one
  token over the budget under each overlong setting. Exact integers.
- The recurrence over a 65,600-token packed row against transformers' own PyTorch function run on
  each sequence alone (fp32; tolerance 1e-5 relative: the same chunked math, summed in a
  different order across 1,025 chunks), and the state kept finite and bounded.
- A tiny patched Qwen3.5 on a 16,384-token row of sequences up to 9,000 tokens against stock
  transformers running each sequence alone: logits, loss and every gradient (fp32; test_patching's
  tolerances, 1e-5 global and 1e-4 per tensor).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from axolotl_fastqwen import patch_model
from axolotl_fastqwen.boundaries import Boundaries
from axolotl_fastqwen.ops.gated_delta_rule import reference_gated_delta_rule
from axolotl_fastqwen.packing import PackedCollator, plan_bins
from axolotl_fastqwen.packing.planner import Piece
from axolotl_fastqwen.transformers_functions import stock_torch_kernels, torch_fallback
from test_patching import TOL, alone_loss_and_grads, assert_packed_training_matches, model_for, rel, sequences

NATIVE = 262_144  # Qwen3.5's native context


def _row(lengths: list[int], budget: int) -> dict:
    return PackedCollator(budget)([{"input_ids": np.full(n, 7), "labels": np.full(n, 7)} for n in lengths])


@pytest.mark.parametrize("lengths", [[NATIVE], [NATIVE - 64, 1], [100_000, 90_000, 72_144], [131_071, 131_073]])
def test_packer_offsets_and_positions_at_the_native_context(lengths):
    row = _row(lengths, NATIVE)
    cu = [0, *np.cumsum(lengths).tolist()]
    if cu[-1] < NATIVE:
        cu.append(NATIVE)  # the padding tail is its own segment
    assert row["input_ids"].shape == (1, NATIVE)
    assert row["cu_seq_lens_q"].dtype == torch.int32 and row["cu_seq_lens_q"].tolist() == cu
    assert row["max_length_q"] == max(b - a for a, b in zip(cu, cu[1:]))
    positions = row["position_ids"][0]
    for k, (a, b) in enumerate(zip(cu, cu[1:])):
        assert positions[a] == 0 and positions[b - 1] == b - a - 1
        assert bool((row["seq_idx"][0, a:b] == k).all())
        assert row["labels"][0, a] == -100  # each sequence's first label
    assert row["seq_idx"].dtype == torch.int32
    b = Boundaries.from_cu_seqlens(row["cu_seq_lens_q"], device=torch.device("cpu"), host=row["cu_seq_lens_q"])
    assert b.cu_seqlens_int64().tolist() == cu


def test_planner_single_sequence_rows_and_one_token_over_the_budget():
    lengths = [NATIVE, NATIVE, NATIVE + 1, 5, NATIVE - 5]
    with pytest.raises(ValueError, match="2"):  # the overlong sample is named, not silently cut
        plan_bins(lengths, NATIVE)
    split = [item for b in plan_bins(lengths, NATIVE, overlong="split") for item in b]
    assert Piece(2, 0, NATIVE) in split and Piece(2, NATIVE, NATIVE + 1) in split
    truncated = plan_bins(lengths, NATIVE, overlong="truncate")
    assert sorted(len(b) for b in truncated) == [1, 1, 1, 2]  # three full rows, 5 + (budget - 5) in one
    assert Piece(2, 0, NATIVE) in [item for b in truncated for item in b]


def _gdn(T: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return r(1, T, 2, 16), r(1, T, 2, 16), r(1, T, 4, 8), r(1, T, 4), r(1, T, 4), r(4) * 0.5 - 2.0, r(4) * 0.5


def test_gated_delta_rule_over_a_65k_token_row_is_each_sequence_alone_through_transformers():
    """A 40,000-token sequence, a 1-token one and a 25,599-token one: the state is carried over 625
    chunks without drifting from stock's own function, and never crosses a boundary."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as mq

    lengths = [40_000, 1, 25_599]
    q, k, v, a, b, A_log, dt = _gdn(sum(lengths))
    cu = torch.tensor([0, *np.cumsum(lengths).tolist()])
    ours = reference_gated_delta_rule(q, k, v, a, b, A_log, dt,
                                      boundaries=Boundaries.from_cu_seqlens(cu, device=torch.device("cpu"), host=cu))
    stock_fn = torch_fallback(mq.torch_chunk_gated_delta_rule)
    alone = []
    for s, e in zip(cu.tolist(), cu[1:].tolist()):
        gate = -A_log.exp() * F.softplus(a[:, s:e] + dt)
        out, state = stock_fn(q[:, s:e].repeat_interleave(2, 2), k[:, s:e].repeat_interleave(2, 2), v[:, s:e],
                              g=gate, beta=b[:, s:e].sigmoid(), use_qk_l2norm_in_kernel=True,
                              output_final_state=True)
        assert torch.isfinite(state).all() and float(state.abs().max()) < 1e3
        alone.append(out)
    alone = torch.cat(alone, 1)
    assert torch.isfinite(ours).all()
    assert rel(ours, alone) <= 1e-5
    assert rel(ours[:, -1000:], alone[:, -1000:]) <= 1e-5  # the end of the longest run, too


def test_a_16k_row_of_long_sequences_trains_as_each_sequence_alone():
    family, lengths = "qwen3_5", [9_000, 1, 4_000, 3_383]
    budget = sum(lengths)
    model = model_for(family)
    seqs = sequences(model.config.vocab_size, lengths)
    with stock_torch_kernels(family), torch.no_grad():
        alone_logits = torch.cat([model(input_ids=s[None]).logits[0] for s in seqs])
    alone_loss, alone_grads = alone_loss_and_grads(model, seqs, family)
    patch_model(model)
    batch = PackedCollator(budget)([{"input_ids": s.tolist(), "labels": s.tolist()} for s in seqs])
    with torch.no_grad():
        packed_logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits[0]
    assert rel(packed_logits, alone_logits) <= TOL
    assert_packed_training_matches(model, batch, alone_loss, alone_grads)
