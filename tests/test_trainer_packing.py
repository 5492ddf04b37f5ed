"""The packer's wiring into Axolotl's trainer (`integration/trainer_packing.py`), without a training
run: `fastqwen_overlong` applied to a tokenized dataset exactly at the budget's edge."""

from __future__ import annotations

import pytest

pytest.importorskip("axolotl")
from datasets import Dataset  # noqa: E402

from axolotl_fastqwen.integration.trainer_packing import fit_to_budget  # noqa: E402

BUDGET = 64


def dataset(lengths):
    rows = [list(range(100 * i, 100 * i + n)) for i, n in enumerate(lengths)]
    return Dataset.from_dict({"input_ids": rows, "labels": rows, "attention_mask": [[1] * len(r) for r in rows],
                              "position_ids": [list(range(len(r))) for r in rows]}), rows


@pytest.mark.parametrize("mode", ["truncate", "split"])
def test_overlong_at_the_boundary_through_the_adapter(mode):
    """budget tokens: kept whole; budget + 1: cut (truncate: the first budget tokens; split: budget and
    1, the piece's positions restarting at 0). No row Axolotl's dataloader gets is over the budget."""
    data, rows = dataset([BUDGET, BUDGET + 1, BUDGET - 1])
    out, cut = fit_to_budget(data, BUDGET, mode)
    assert cut["overlong_samples"] == 1 and cut["tokens_in_overlong"] == BUDGET + 1
    ids = out["input_ids"]
    assert max(map(len, ids)) == BUDGET
    if mode == "truncate":
        assert ids == [rows[0], rows[1][:BUDGET], rows[2]] and cut["tokens_dropped"] == 1
    else:
        assert ids == [rows[0], rows[1][:BUDGET], rows[1][BUDGET:], rows[2]] and cut["pieces"] == 2
        assert out["position_ids"][2] == [0] and out["labels"][2] == rows[1][BUDGET:]
    assert out["labels"] == ids


def test_exactly_the_budget_is_not_overlong_and_one_more_is_refused_by_default():
    data, _ = dataset([BUDGET, BUDGET - 1])
    out, cut = fit_to_budget(data, BUDGET, "error")
    assert out is data and cut["overlong_samples"] == 0
    data, _ = dataset([BUDGET, BUDGET + 1])
    with pytest.raises(ValueError, match=f"1 sample is longer than the token budget of {BUDGET} tokens: "
                                         f"dataset index 1 \\({BUDGET + 1} tokens"):
        fit_to_budget(data, BUDGET, "error")
