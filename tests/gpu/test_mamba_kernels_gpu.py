"""Mamba-1 selective scan and Mamba-2 SSD Triton kernels == their references on CUDA at mamba-370m sizes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rnnserve.kernels.selective_scan import selective_scan_varlen, selective_state_update
from rnnserve.kernels.selective_scan.chunk import selective_scan_varlen_triton
from rnnserve.kernels.selective_scan.naive import selective_scan_ref, selective_state_update_ref
from rnnserve.kernels.ssd import ssd_scan_varlen, ssd_state_update
from rnnserve.kernels.ssd.naive import ssd_scan_ref
from rnnserve.kernels.ssd.torch_recurrent import ssd_state_update_torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

DEVICE = "cuda"
LENGTHS = [1, 3, 64, 65, 500, 1, 700]


def _cu_seqlens(lengths: list[int]) -> torch.Tensor:
    return F.pad(torch.tensor(lengths).cumsum(0), (1, 0)).to(DEVICE)


def _tol(dtype: torch.dtype) -> dict[str, float]:
    return {"rtol": 1e-3, "atol": 1e-3} if dtype == torch.float32 else {"rtol": 3e-2, "atol": 3e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_selective_scan_prefill_and_decode(dtype):
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    total, d_inner, d_state = sum(LENGTHS), 2048, 16
    x, dt, z = (torch.randn(total, d_inner, device=DEVICE, generator=gen).to(dtype) for _ in range(3))
    B, C = (torch.randn(total, d_state, device=DEVICE, generator=gen).to(dtype) for _ in range(2))
    A = -torch.rand(d_inner, d_state, device=DEVICE, generator=gen) - 0.1
    D, bias = torch.randn(d_inner, device=DEVICE), torch.randn(d_inner, device=DEVICE) - 3
    h0 = torch.randn(len(LENGTHS), d_inner, d_state, device=DEVICE)
    cu = _cu_seqlens(LENGTHS)
    y, final = selective_scan_varlen(x, dt, A, B, C, cu, D, z, h0, bias, True)
    y_ref, final_ref = selective_scan_ref(x, dt, A, B, C, cu, D, z, h0, bias, True)
    torch.testing.assert_close(y, y_ref, **_tol(dtype))
    torch.testing.assert_close(final, final_ref, **_tol(dtype))
    pool = torch.randn(300, 2, d_inner, d_state, device=DEVICE)
    expected = pool[:, 1].clone()
    slots = torch.randperm(300, device=DEVICE)[:256]
    step = [t[:256] for t in (x, dt, B, C, z)]
    y = selective_state_update(pool[:, 1], slots, step[0], step[1], A, step[2], step[3], D, step[4], bias, True)
    y_ref, h_ref = selective_state_update_ref(expected[slots], step[0], step[1], A, step[2], step[3], D, step[4],
                                              bias, True)
    torch.testing.assert_close(y, y_ref, **_tol(dtype))
    torch.testing.assert_close(pool[:, 1][slots], h_ref, rtol=1e-4, atol=1e-4)


def test_selective_scan_segments_on_pool_slots_and_bf16_output():
    """Long prompts split into parallel segments, states read from and written to pool slots in place, and y
    stored in bf16 equal to the fp32 y rounded."""
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    lengths, d_inner, d_state = [1500, 3, 0, 1025, 2048], 2048, 16
    total = sum(lengths)
    x, dt, z = (torch.randn(total, d_inner, device=DEVICE, generator=gen).to(torch.bfloat16) for _ in range(3))
    B, C = (torch.randn(total, d_state, device=DEVICE, generator=gen).to(torch.bfloat16) for _ in range(2))
    A = -torch.rand(d_inner, d_state, device=DEVICE, generator=gen) - 0.1
    D, bias = torch.randn(d_inner, device=DEVICE), torch.randn(d_inner, device=DEVICE) - 3
    pool = torch.randn(40, 2, d_inner, d_state, device=DEVICE)
    before = pool.clone()
    slots = torch.randperm(40, device=DEVICE)[: len(lengths)]
    cu = _cu_seqlens(lengths)
    args = (x, dt, A, B, C, cu, D, z)
    y, _ = selective_scan_varlen_triton(*args, initial_state=pool[:, 1], dt_bias=bias, dt_softplus=True,
                                        slot_ids=slots, out_dtype=torch.bfloat16)
    y_ref, final_ref = selective_scan_ref(*args, before[:, 1][slots], bias, True)
    torch.testing.assert_close(y.float(), y_ref, rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(pool[:, 1][slots], final_ref, rtol=1e-3, atol=1e-3)
    others = torch.ones(40, dtype=torch.bool, device=DEVICE)
    others[slots] = False
    assert torch.equal(pool[others], before[others]) and torch.equal(pool[:, 0], before[:, 0])
    y32, _ = selective_scan_varlen_triton(*args, initial_state=before[:, 1][slots], dt_bias=bias, dt_softplus=True)
    assert torch.equal(y, y32.to(torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ssd_prefill_and_decode(dtype):
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    total, heads, head_dim, groups, d_state = sum(LENGTHS), 32, 64, 1, 128
    x = torch.randn(total, heads, head_dim, device=DEVICE, generator=gen).to(dtype)
    dt = torch.rand(total, heads, device=DEVICE, generator=gen) * 0.1
    B, C = (torch.randn(total, groups, d_state, device=DEVICE, generator=gen).to(dtype) for _ in range(2))
    A = -torch.arange(1, heads + 1, device=DEVICE, dtype=torch.float32)
    D = torch.ones(heads, device=DEVICE)
    h0 = torch.randn(len(LENGTHS), heads, head_dim, d_state, device=DEVICE)
    cu = _cu_seqlens(LENGTHS)
    y, final = ssd_scan_varlen(x, dt, A, B, C, cu, D, h0)
    y_ref, final_ref = ssd_scan_ref(x, dt, A, B, C, cu, D, h0)
    torch.testing.assert_close(y, y_ref, **_tol(dtype))
    torch.testing.assert_close(final, final_ref, **_tol(dtype))
    pool = torch.randn(300, heads, head_dim, d_state, device=DEVICE)
    expected = pool.clone()
    slots = torch.randperm(300, device=DEVICE)[:64]
    y = ssd_state_update(pool, slots, x[:64], dt[:64], A, B[:64], C[:64], D)
    y_ref = ssd_state_update_torch(expected, slots, x[:64], dt[:64], A, B[:64], C[:64], D)
    torch.testing.assert_close(y, y_ref, **_tol(dtype))
    torch.testing.assert_close(pool, expected, rtol=1e-4, atol=1e-4)
