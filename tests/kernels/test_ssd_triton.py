"""Triton Mamba-2 SSD (chunked varlen prefill in three kernels, slot-addressed decode) == the PyTorch reference."""

from __future__ import annotations

import pytest
import torch

from rnnserve.kernels.ssd import ssd_scan_varlen, ssd_state_update
from rnnserve.kernels.ssd.chunk import ssd_scan_varlen_triton
from rnnserve.kernels.ssd.naive import ssd_scan_ref
from rnnserve.kernels.ssd.torch_recurrent import ssd_state_update_torch
from tests.kernels.kernel_cases import LENGTHS, cu_seqlens_of, slot_ids_for

HEADS, HEAD_DIM, GROUPS, D_STATE, NUM_SLOTS = 4, 24, 2, 48, 12  # d_state spans two 32-wide blocks


def _inputs(total: int, dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "x": torch.randn(total, HEADS, HEAD_DIM, generator=gen).to(dtype),
        "dt": torch.rand(total, HEADS, generator=gen) * 0.5,
        "A": -torch.rand(HEADS, generator=gen) - 0.1,
        "B": torch.randn(total, GROUPS, D_STATE, generator=gen).to(dtype),
        "C": torch.randn(total, GROUPS, D_STATE, generator=gen).to(dtype),
        "D": torch.randn(HEADS, generator=gen),
    }


# fp16 rather than bf16 for the low-precision case: Triton 3.9's interpreter computes bf16 tl.dot wrongly.
@pytest.mark.parametrize("dtype, chunk_size, atol", [(torch.float32, 16, 1e-4), (torch.float32, 64, 1e-4),
                                                     (torch.float16, 32, 5e-2)])
def test_varlen_prefill_matches_reference(triton_on_cpu, dtype, chunk_size, atol):
    args = _inputs(sum(LENGTHS), dtype)
    cu = cu_seqlens_of(LENGTHS)
    h0 = torch.randn(len(LENGTHS), HEADS, HEAD_DIM, D_STATE)
    h0[1] = 0.0
    y, final = ssd_scan_varlen_triton(**args, cu_seqlens=cu, initial_state=h0, chunk_size=chunk_size)
    y_ref, final_ref = ssd_scan_ref(**args, cu_seqlens=cu, initial_state=h0)
    assert y.dtype == final.dtype == torch.float32
    torch.testing.assert_close(y, y_ref, rtol=atol, atol=atol)
    torch.testing.assert_close(final, final_ref, rtol=atol, atol=atol)


def test_prefill_reads_and_writes_pool_slots(triton_on_cpu):
    args = _inputs(sum(LENGTHS), torch.float32, seed=1)
    del args["D"]
    cu = cu_seqlens_of(LENGTHS)
    pool = torch.randn(NUM_SLOTS, 3, HEADS, HEAD_DIM, D_STATE)
    before = pool.clone()
    slots = slot_ids_for(len(LENGTHS), NUM_SLOTS)
    y, returned = ssd_scan_varlen_triton(**args, cu_seqlens=cu, initial_state=pool[:, 2], slot_ids=slots)
    y_ref, final_ref = ssd_scan_ref(**args, cu_seqlens=cu, initial_state=before[:, 2][slots])
    assert returned.data_ptr() == pool[:, 2].data_ptr()
    torch.testing.assert_close(y, y_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(pool[:, 2][slots], final_ref, rtol=1e-4, atol=1e-4)
    untouched = torch.ones(NUM_SLOTS, dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(pool[untouched], before[untouched]) and torch.equal(pool[:, :2], before[:, :2])


def test_prefill_without_initial_state(triton_on_cpu):
    lengths = [70, 3]
    args = _inputs(sum(lengths), torch.float32, seed=2)
    cu = cu_seqlens_of(lengths)
    y, final = ssd_scan_varlen(**args, cu_seqlens=cu)
    y_ref, final_ref = ssd_scan_ref(**args, cu_seqlens=cu)
    torch.testing.assert_close(y, y_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(final, final_ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype, consecutive", [(torch.float32, False), (torch.bfloat16, True)])
def test_decode_updates_slots_in_place(triton_on_cpu, dtype, consecutive):
    batch = 5
    args = _inputs(batch, dtype, seed=3)
    pool = torch.randn(NUM_SLOTS, 2, HEADS, HEAD_DIM, D_STATE)
    expected = pool.clone()
    slot_ids = torch.arange(3, 3 + batch) if consecutive else slot_ids_for(batch, NUM_SLOTS, seed=4)
    slots = slice(3, 3 + batch) if consecutive else slot_ids
    y = ssd_state_update(pool[:, 1], slots, **args)
    y_ref = ssd_state_update_torch(expected[:, 1], slot_ids, **args)
    torch.testing.assert_close(y, y_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(pool, expected, rtol=1e-4, atol=1e-4)
