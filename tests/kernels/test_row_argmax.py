"""The greedy argmax kernel equals torch.argmax (first maximum) in both memory layouts."""

from __future__ import annotations

import pytest
import torch

from rnnserve.kernels.cpu_extension import cpu_ops
from rnnserve.kernels.row_argmax import row_argmax


@pytest.mark.skipif(not cpu_ops(), reason="fused CPU kernels could not be built")
@pytest.mark.parametrize("rows", [1, 3, 32, 37])
@pytest.mark.parametrize("transposed", [False, True])
def test_matches_torch_argmax_with_ties(rows: int, transposed: bool) -> None:
    g = torch.Generator().manual_seed(rows)
    vocab = 5000
    logits = torch.randn(vocab, rows, generator=g).t() if transposed else torch.randn(rows, vocab, generator=g)
    peak = logits.max() + 1
    for r in range(rows):  # a tie at two positions: the first must win, wherever the thread split falls
        first, second = torch.randperm(vocab, generator=g)[:2].tolist()
        logits[r, first] = logits[r, second] = peak
    assert rows == 1 or logits.is_contiguous() != transposed
    assert torch.equal(row_argmax(logits), logits.argmax(dim=-1))


@pytest.mark.skipif(not cpu_ops(), reason="fused CPU kernels could not be built")
def test_all_equal_and_nan_rows_give_valid_indices() -> None:
    logits = torch.zeros(2, 2048)
    logits[1] = float("nan")
    out = row_argmax(logits)
    assert out[0] == 0 and 0 <= out[1] < 2048


def test_small_or_other_dtypes_use_torch() -> None:
    logits = torch.randn(4, 10, dtype=torch.float64)
    assert torch.equal(row_argmax(logits), logits.argmax(dim=-1))
