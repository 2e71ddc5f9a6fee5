"""Inputs the kernels cannot take are refused on every path, and pool rows given as a slice are the rows
``pool[slice]`` names: a kernel probe found Triton and C++ paths that read past their inputs (heads that do not
share B/C or key/value heads in equal groups) or took a slice's first rows whatever its step."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

from rnnserve.kernels.backend import force_triton
from rnnserve.kernels.selective_scan import selective_state_update
from rnnserve.kernels.selective_scan.torch_recurrent import selective_state_update_torch
from rnnserve.kernels.sliding_window import sliding_window_decode, sliding_window_prefill
from rnnserve.kernels.ssd import ssd_scan_varlen, ssd_state_update
from rnnserve.kernels.ssd.torch_recurrent import ssd_state_update_torch
from tests.kernels.conftest import HAS_TRITON

INTERPRETED = HAS_TRITON and os.environ.get("TRITON_INTERPRET") == "1"
TRITON = pytest.param("triton", marks=pytest.mark.skipif(not INTERPRETED, reason="needs TRITON_INTERPRET=1"))
PATHS = ["default", TRITON]


def on_path(path: str) -> contextlib.AbstractContextManager:
    return force_triton(True) if path == "triton" else contextlib.nullcontext()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("heads", "groups"), [(3, 2), (2, 4)])
def test_ssd_refuses_heads_that_do_not_share_b_and_c_in_equal_groups(path: str, heads: int, groups: int) -> None:
    g = torch.Generator().manual_seed(0)
    x, dt = torch.randn(5, heads, 4, generator=g), torch.rand(5, heads, generator=g)
    A, B, C = -torch.rand(heads, generator=g), torch.randn(5, groups, 8, generator=g), torch.randn(5, groups, 8)
    with on_path(path), pytest.raises(ValueError, match="equal groups"):
        ssd_scan_varlen(x, dt, A, B, C, torch.tensor([0, 2, 5]))
    with on_path(path), pytest.raises(ValueError, match="equal groups"):
        ssd_state_update(torch.zeros(6, heads, 4, 8), slice(0, 5), x, dt, A, B, C)


@pytest.mark.parametrize("path", PATHS)
def test_sliding_window_refuses_query_heads_that_do_not_share_kv_heads_in_equal_groups(path: str) -> None:
    q, k = torch.randn(4, 3, 8), torch.randn(4, 2, 8)
    rings = torch.zeros(2, 4, 2, 8), torch.zeros(2, 4, 2, 8)
    with on_path(path), pytest.raises(ValueError, match="equal groups"):
        sliding_window_prefill(q, k, k, torch.tensor([0, 2, 4]), torch.tensor([0, 0]), *rings, 0.3)
    with on_path(path), pytest.raises(ValueError, match="equal groups"):
        sliding_window_decode(q[:2], k[:2], k[:2], torch.tensor([3, 1]), *rings, torch.tensor([1, 0]), 0.3)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("slots", [slice(0, 6, 2), slice(None, 3), slice(3, None)])
@torch.inference_mode()
def test_decode_updates_take_a_slice_of_pool_rows_as_indexing_does(path: str, slots: slice) -> None:
    """``slice(0, 6, 2)`` updated rows 0, 1, 2 on the fused paths, and open-ended slices raised TypeError."""
    g = torch.Generator().manual_seed(1)
    rows = len(range(*slots.indices(6)))
    ssd = {"x": torch.randn(rows, 4, 8, generator=g), "dt": torch.rand(rows, 4, generator=g),
           "A": -torch.rand(4, generator=g), "B": torch.randn(rows, 2, 16, generator=g),
           "C": torch.randn(rows, 2, 16, generator=g)}  # fmt: skip
    mamba = {"x": torch.randn(rows, 8, generator=g), "dt": torch.rand(rows, 8, generator=g),
             "A": -torch.rand(8, 4, generator=g), "B": torch.randn(rows, 4, generator=g),
             "C": torch.randn(rows, 4, generator=g)}  # fmt: skip
    cases = [(ssd_state_update, ssd_state_update_torch, (6, 4, 8, 16), ssd),
             (selective_state_update, selective_state_update_torch, (6, 8, 4), mamba)]  # fmt: skip
    for update, reference, pool_shape, inputs in cases:
        pool = torch.randn(pool_shape, generator=g)
        expected = pool.clone()
        want = reference(expected, slots, **inputs)
        with on_path(path):
            got = update(pool, slots, **inputs)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(pool, expected, atol=1e-5, rtol=1e-5)
