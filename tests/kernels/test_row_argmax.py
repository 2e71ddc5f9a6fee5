"""The greedy argmax kernel equals the reference (torch.argmax: the first maximum) in both memory layouts."""

from __future__ import annotations

import pytest
import torch

from rnnserve.kernels.cpu_extension import cpu_ops
from rnnserve.kernels.row_argmax import row_argmax
from rnnserve.kernels.row_argmax.naive import row_argmax_ref

needs_cpu_kernels = pytest.mark.skipif(not cpu_ops(), reason="fused CPU kernels could not be built")


def layout(values: torch.Tensor, transposed: bool) -> torch.Tensor:
    """``values [R, V]`` with rows contiguous, or as the transposed view of a ``[V, R]`` tensor."""
    return values.t().contiguous().t() if transposed else values.contiguous()


@needs_cpu_kernels
@pytest.mark.parametrize("rows", [1, 3, 32, 37])
@pytest.mark.parametrize("transposed", [False, True])
def test_matches_reference_with_ties(rows: int, transposed: bool) -> None:
    g = torch.Generator().manual_seed(rows)
    vocab = 5000
    logits = torch.randn(rows, vocab, generator=g)
    peak = logits.max() + 1
    for r in range(rows):  # a tie at two positions: the first must win, wherever the thread split falls
        first, second = torch.randperm(vocab, generator=g)[:2].tolist()
        logits[r, first] = logits[r, second] = peak
    logits = layout(logits, transposed)
    assert rows == 1 or logits.is_contiguous() != transposed
    assert torch.equal(row_argmax(logits), row_argmax_ref(logits))


@needs_cpu_kernels
@pytest.mark.parametrize("vocab", [1, 7, 257, 1023, 1024])
@pytest.mark.parametrize("transposed", [False, True])
def test_kernel_matches_reference_on_any_vocabulary(vocab: int, transposed: bool) -> None:
    """Rows full of ties and a row of ``-inf``, through the dispatcher (the kernel takes every vocabulary)."""
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randint(-2, 3, (6, vocab), generator=g).float()
    logits[4] = float("-inf")
    logits = layout(logits, transposed)
    assert torch.equal(row_argmax(logits), row_argmax_ref(logits))


@needs_cpu_kernels
def test_all_equal_and_nan_rows_give_valid_indices() -> None:
    logits = torch.zeros(2, 2048)
    logits[1] = float("nan")
    out = row_argmax(logits)
    assert out[0] == 0 and 0 <= out[1] < 2048
