"""The SSD op: varlen prefill (the op and its chunked PyTorch form) and in-place decode update == token-by-token
reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rnnserve.kernels.ssd import ssd_scan_varlen, ssd_state_update
from rnnserve.kernels.ssd.naive import ssd_scan_ref
from rnnserve.kernels.ssd.torch_chunked import ssd_scan_chunked


def _inputs(lengths: list[int], heads: int = 4, groups: int = 2, head_dim: int = 3, d_state: int = 5) -> dict:
    g = torch.Generator().manual_seed(0)
    total = sum(lengths)
    return {
        "x": torch.randn(total, heads, head_dim, generator=g),
        "dt": F.softplus(torch.randn(total, heads, generator=g)),
        "A": -torch.rand(heads, generator=g) * 3,
        "B": torch.randn(total, groups, d_state, generator=g),
        "C": torch.randn(total, groups, d_state, generator=g),
        "cu_seqlens": torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()]),
        "D": torch.randn(heads, generator=g),
        "initial_state": torch.randn(len(lengths), heads, head_dim, d_state, generator=g),
    }


@pytest.mark.parametrize("chunk_size", [1, 4, 16])
@pytest.mark.parametrize("lengths", [[1], [5, 1, 9, 4], [17, 16, 2]])
def test_chunked_matches_reference(lengths: list[int], chunk_size: int) -> None:
    args = _inputs(lengths)
    y_ref, h_ref = ssd_scan_ref(**args)
    for y, h in (ssd_scan_varlen(**args, chunk_size=chunk_size), ssd_scan_chunked(**args, chunk_size=chunk_size)):
        torch.testing.assert_close(y, y_ref, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(h, h_ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("consecutive", [True, False])
def test_state_update_in_place_matches_reference(consecutive: bool) -> None:
    args = _inputs([1, 1, 1])
    y_ref, h_ref = ssd_scan_ref(**args)
    pool = torch.randn(6, 4, 3, 5)
    slot_ids = torch.tensor([2, 3, 4]) if consecutive else torch.tensor([4, 0, 2])
    pool[slot_ids] = args["initial_state"]
    untouched = pool[[1, 5]].clone()
    step = {k: args[k] for k in ("x", "dt", "A", "B", "C", "D")}
    y = ssd_state_update(pool, slice(2, 5) if consecutive else slot_ids, **step)
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool[slot_ids], h_ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(pool[[1, 5]], untouched)
