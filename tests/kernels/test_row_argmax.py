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


def non_finite_rows(vocab: int) -> torch.Tensor:
    """Rows of random logits with NaN and infinities placed where each lane, thread range and merge meets them:
    NaN first, last, in the tail, beside a +inf or a larger number, several NaN, only NaN, only -inf, -inf with
    one NaN, +inf ties; 20 rows, so that the transposed pass has a full block of rows and a partial one."""
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(20, vocab, generator=g)
    nan, inf = float("nan"), float("inf")
    last = vocab - 1
    logits[0, 0] = nan
    logits[1, last] = nan
    logits[2, [3, last - 2]] = torch.tensor([inf, nan])
    logits[3, [last - 2, 3]] = torch.tensor([inf, nan])
    logits[4, [vocab // 3, vocab // 2, 5]] = nan
    logits[5] = nan
    logits[6] = -inf
    logits[7] = -inf
    logits[7, vocab // 2] = nan
    logits[8, [vocab // 2, 7]] = inf
    logits[9, [7, vocab // 2]] = torch.tensor([-inf, inf])
    logits[10, 7] = 1e30
    logits[10, last - 1] = nan
    logits[11, :] = -inf
    logits[11, last] = -3.0
    logits[12, 17 % vocab] = nan
    logits[12, 1] = inf
    logits[13, torch.arange(vocab) % 16 == 5] = nan  # one lane full of NaN
    logits[14, 1:] = nan  # every position but the first
    logits[16, [2, 1]] = nan
    logits[17] = -inf
    logits[17, last] = inf
    logits[18, vocab // 2 + 3] = nan
    return logits


@needs_cpu_kernels
@pytest.mark.parametrize("vocab", [33, 1000, 5003])
@pytest.mark.parametrize("transposed", [False, True])
def test_nan_and_infinities_order_as_in_torch(vocab: int, transposed: bool) -> None:
    """torch.argmax's order: a NaN above every number (the first NaN wins), -inf below (a row of it gives 0)."""
    logits = layout(non_finite_rows(vocab), transposed)
    expected = row_argmax_ref(logits)
    assert expected[0] == 0 and expected[5] == 0 and expected[6] == 0 and expected[7] == vocab // 2
    assert torch.equal(torch.ops.rnnserve.row_argmax(logits), expected)
