"""Triton Mamba-1 selective scan (chunked varlen prefill, slot-addressed decode) == the PyTorch reference."""

from __future__ import annotations

import pytest
import torch

from rnnserve.kernels.backend import force_triton
from rnnserve.kernels.selective_scan import selective_scan_varlen, selective_state_update
from rnnserve.kernels.selective_scan.chunk import selective_scan_varlen_triton
from rnnserve.kernels.selective_scan.naive import selective_scan_ref, selective_state_update_ref
from tests.kernels.kernel_cases import assert_other_rows_untouched, cu_seqlens_of, slot_ids_for

D_INNER, D_STATE, NUM_SLOTS = 20, 16, 12  # channels not a power of two: exercises the mask
LENGTHS = [5, 1, 35, 16]  # under, at and over the 16-token chunk, several chunks with a remainder


def _inputs(total: int, dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    return {
        "x": randn(total, D_INNER).to(dtype),
        "dt": randn(total, D_INNER).to(dtype),
        "A": -torch.rand(D_INNER, D_STATE, generator=gen) - 0.1,
        "B": randn(total, D_STATE).to(dtype),
        "C": randn(total, D_STATE).to(dtype),
        "D": randn(D_INNER),
        "z": randn(total, D_INNER).to(dtype),
        "dt_bias": randn(D_INNER),
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_varlen_prefill_matches_reference(triton_on_cpu, dtype):
    args = _inputs(sum(LENGTHS), dtype)
    cu = cu_seqlens_of(LENGTHS)
    h0 = torch.randn(len(LENGTHS), D_INNER, D_STATE)
    h0[1] = 0.0
    y, final = selective_scan_varlen(**args, cu_seqlens=cu, initial_state=h0, dt_softplus=True)
    y_ref, final_ref = selective_scan_ref(**args, cu_seqlens=cu, initial_state=h0, dt_softplus=True)
    assert y.dtype == final.dtype == torch.float32
    torch.testing.assert_close(y, y_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(final, final_ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("block_d, num_warps, segment_len", [(4, 1, 0), (32, 2, 16), (8, 4, 8)])
def test_every_launch_choice_gives_the_same_scan(triton_on_cpu, block_d, num_warps, segment_len):
    """The launch choices benchmarks/scan_tune.py times (channel blocks narrower or wider than D_INNER)."""
    args = _inputs(sum(LENGTHS), torch.float32, seed=2)
    cu = cu_seqlens_of(LENGTHS)
    h0 = torch.randn(len(LENGTHS), D_INNER, D_STATE)
    y, final = selective_scan_varlen_triton(**args, cu_seqlens=cu, initial_state=h0, dt_softplus=True,
                                            block_d=block_d, num_warps=num_warps, segment_len=segment_len)
    y_ref, final_ref = selective_scan_ref(**args, cu_seqlens=cu, initial_state=h0, dt_softplus=True)
    torch.testing.assert_close(y, y_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(final, final_ref, rtol=1e-4, atol=1e-4)


def test_prefill_reads_and_writes_pool_slots(triton_on_cpu):
    args = _inputs(sum(LENGTHS), torch.float32, seed=1)
    del args["z"], args["D"]
    cu = cu_seqlens_of(LENGTHS)
    pool = torch.randn(NUM_SLOTS, 3, D_INNER, D_STATE)  # a layer view of a [slots, layers, ...] pool
    before = pool.clone()
    slots = slot_ids_for(len(LENGTHS), NUM_SLOTS)
    y, returned = selective_scan_varlen_triton(
        **args, cu_seqlens=cu, initial_state=pool[:, 1], dt_softplus=True, slot_ids=slots, segment_len=0
    )
    y_ref, final_ref = selective_scan_ref(**args, cu_seqlens=cu, initial_state=before[:, 1][slots], dt_softplus=True)
    assert returned.data_ptr() == pool[:, 1].data_ptr()
    torch.testing.assert_close(y, y_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(pool[:, 1][slots], final_ref, rtol=1e-4, atol=1e-4)
    assert_other_rows_untouched(pool, before, slots, 1)


@pytest.mark.parametrize("triton", [True, False], ids=["triton", "copies"])
def test_public_scan_on_pool_slots(triton_on_cpu, triton):
    """selective_scan_varlen with slot ids, as the model calls it: both paths leave the same pool."""
    args = _inputs(sum(LENGTHS), torch.bfloat16, seed=3)
    cu = cu_seqlens_of(LENGTHS)
    pool = torch.randn(NUM_SLOTS, 2, D_INNER, D_STATE)
    before = pool.clone()
    slots = slot_ids_for(len(LENGTHS), NUM_SLOTS, seed=7)
    with force_triton(triton):
        y, returned = selective_scan_varlen(**args, cu_seqlens=cu, initial_state=pool[:, 1], dt_softplus=True,
                                            out_dtype=torch.bfloat16, slot_ids=slots)
    y_ref, final_ref = selective_scan_ref(**args, cu_seqlens=cu, initial_state=before[:, 1][slots], dt_softplus=True)
    assert returned.data_ptr() == pool[:, 1].data_ptr() and y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), y_ref, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(pool[:, 1][slots], final_ref, rtol=1e-4, atol=1e-4)
    assert_other_rows_untouched(pool, before, slots, 1)


@pytest.mark.parametrize("segment_len, pool", [(16, True), (8, False), (32, True), (0, False)])
def test_segments_scanned_in_parallel_give_the_same_scan(triton_on_cpu, segment_len, pool):
    """Long sequences cut into segments (two launches: segment end states, then the scan from the folded
    states): ragged lengths, an empty sequence, the initial state from pool slots out of order."""
    lengths = [5, 0, 35, 20]
    args = _inputs(sum(lengths), torch.float32, seed=5)
    cu = cu_seqlens_of(lengths)
    slots = slot_ids_for(len(lengths), NUM_SLOTS, seed=6)
    states = torch.randn(NUM_SLOTS, D_INNER, D_STATE)
    before = states.clone()
    launch = {"segment_len": segment_len, "block_d": 8}
    if pool:
        y, final = selective_scan_varlen_triton(**args, cu_seqlens=cu, initial_state=states, dt_softplus=True,
                                                slot_ids=slots, **launch)
        final = final[slots]
    else:
        y, final = selective_scan_varlen_triton(**args, cu_seqlens=cu, initial_state=before[slots],
                                                dt_softplus=True, **launch)
    y_ref, final_ref = selective_scan_ref(**args, cu_seqlens=cu, initial_state=before[slots], dt_softplus=True)
    torch.testing.assert_close(y, y_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(final, final_ref, rtol=1e-4, atol=1e-4)


def test_segments_without_initial_state(triton_on_cpu):
    lengths = [40, 3]
    args = _inputs(sum(lengths), torch.bfloat16, seed=7)
    cu = cu_seqlens_of(lengths)
    y, final = selective_scan_varlen_triton(**args, cu_seqlens=cu, dt_softplus=True, segment_len=16)
    y_ref, final_ref = selective_scan_ref(**args, cu_seqlens=cu, dt_softplus=True)
    torch.testing.assert_close(y, y_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(final, final_ref, rtol=1e-4, atol=1e-4)


def test_output_dtype_is_the_fp32_output_rounded(triton_on_cpu):
    args = _inputs(sum(LENGTHS), torch.float32, seed=8)
    cu = cu_seqlens_of(LENGTHS)
    y, _ = selective_scan_varlen_triton(**args, cu_seqlens=cu, dt_softplus=True, out_dtype=torch.bfloat16)
    y32, _ = selective_scan_varlen_triton(**args, cu_seqlens=cu, dt_softplus=True)
    assert y.dtype == torch.bfloat16
    # Triton's interpreter truncates fp32 -> bf16 where a GPU rounds to nearest (tests/gpu checks equality).
    torch.testing.assert_close(y.float(), y32, rtol=2**-7, atol=0.0)


def test_no_tokens_keeps_every_initial_state(triton_on_cpu):
    args = _inputs(0, torch.float32)
    h0 = torch.randn(2, D_INNER, D_STATE)
    y, final = selective_scan_varlen_triton(**args, cu_seqlens=cu_seqlens_of([0, 0]), initial_state=h0)
    assert y.shape == (0, D_INNER) and torch.equal(final, h0)


def test_prefill_without_initial_state_or_gates(triton_on_cpu):
    lengths = LENGTHS[:3]
    args = _inputs(sum(lengths), torch.float32, seed=2)
    del args["z"], args["D"], args["dt_bias"]
    args["dt"] = args["dt"].abs()
    cu = cu_seqlens_of(lengths)
    y, final = selective_scan_varlen(**args, cu_seqlens=cu)
    y_ref, final_ref = selective_scan_ref(**args, cu_seqlens=cu)
    torch.testing.assert_close(y, y_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(final, final_ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype, consecutive", [(torch.float32, False), (torch.bfloat16, True)])
def test_decode_updates_slots_in_place(triton_on_cpu, dtype, consecutive):
    batch = 5
    args = _inputs(batch, dtype, seed=3)
    pool = torch.randn(NUM_SLOTS, 2, D_INNER, D_STATE)
    before = pool.clone()
    slot_ids = torch.arange(3, 3 + batch) if consecutive else slot_ids_for(batch, NUM_SLOTS, seed=4)
    slots = slice(3, 3 + batch) if consecutive else slot_ids
    y = selective_state_update(pool[:, 1], slots, **args, dt_softplus=True)
    y_ref, h_ref = selective_state_update_ref(before[:, 1][slot_ids], **args, dt_softplus=True)
    torch.testing.assert_close(y, y_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(pool[:, 1][slot_ids], h_ref, rtol=1e-4, atol=1e-4)
    others = torch.ones(NUM_SLOTS, dtype=torch.bool)
    others[slot_ids] = False
    assert torch.equal(pool[others], before[others]) and torch.equal(pool[:, 0], before[:, 0])


def test_softplus_matches_torch_over_its_range(triton_on_cpu):
    """dt spans the softplus regimes, densely: far negative (log1p of a tiny exp), around 0, past the linear
    threshold of 20; the kernel's log1p polynomial keeps every value within 1e-6 of torch's, relatively."""
    dt = torch.cat([torch.linspace(-30.0, 30.0, 6001), torch.tensor([-12.0, 0.0, 19.9, 20.1, 40.0])])[None, :]
    channels = dt.shape[1]
    x = torch.ones(1, channels)
    state = torch.zeros(1, channels, 1)
    A, B, C = -torch.ones(channels, 1), torch.ones(1, 1), torch.ones(1, 1)
    y = selective_state_update(state, torch.tensor([0]), x, dt, A, B, C, dt_softplus=True)
    expected = torch.nn.functional.softplus(dt.double()).float()  # h = dt * x * B with a zero state, y = C h
    torch.testing.assert_close(y, expected, rtol=1e-6, atol=0.0)
