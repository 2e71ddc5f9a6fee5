"""Triton Mamba-2 SSD (tiled chunked varlen prefill, slot-addressed decode) == the PyTorch reference."""

from __future__ import annotations

import pytest
import torch

from rnnserve.kernels.backend import force_triton
from rnnserve.kernels.ssd import ssd_scan_varlen, ssd_state_update
from rnnserve.kernels.ssd.chunk import ssd_scan_varlen_triton
from rnnserve.kernels.ssd.naive import discretize_dt, ssd_scan_ref
from rnnserve.kernels.ssd.torch_recurrent import ssd_state_update_torch
from tests.kernels.kernel_cases import LENGTHS, assert_other_rows_untouched, cu_seqlens_of, slot_ids_for

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


# Tiles of 16 in a 64-token chunk: four row and source blocks per chunk (the causal skip runs), two channel
# blocks over HEAD_DIM 24 and three state steps over D_STATE 48, all partly masked. TILED_LENGTHS (short, for the
# interpreter) has a full chunk followed by a 3-token one, a single token and a chunk ending inside a row block;
# SMALL_TILED is the same in 32-token chunks (two blocks each way) over about half the tokens.
TILED = {"chunk_size": 64, "block_m": 16, "block_k": 16, "block_p": 16, "block_n": 16, "state_block_n": 32}
TILED_LENGTHS = [67, 1, 40]
SMALL_TILED, SMALL_TILED_LENGTHS = {**TILED, "chunk_size": 32}, [35, 1, 20]


# 16-bit x, B and C widen to fp32 exactly, and their one product in the 16-bit dtype (C . B^T) has products
# exact in fp32 and fp32 sums (bf16 through tests/kernels/interpreter_bf16.py, as on a GPU); the rest runs in fp32,
# so every dtype equals the fp32 reference up to summation order. (The interpreter runs the "tf32" dots of
# 16-bit inputs in full fp32: the GPU's tf32 roundings are checked in tests/gpu.)
@pytest.mark.parametrize(
    "dtype, lengths, launch",
    [
        (torch.float32, LENGTHS, {"chunk_size": 16}),
        (torch.float32, LENGTHS, {"chunk_size": 64}),
        (torch.float16, LENGTHS, {"chunk_size": 32}),
        (torch.bfloat16, LENGTHS, {"chunk_size": 32}),
        (torch.float32, SMALL_TILED_LENGTHS, {**SMALL_TILED, "precompute_cb": False}),
        (torch.float16, SMALL_TILED_LENGTHS, SMALL_TILED),
        (torch.bfloat16, SMALL_TILED_LENGTHS, SMALL_TILED),
        (torch.bfloat16, SMALL_TILED_LENGTHS, {**SMALL_TILED, "precompute_cb": False}),
    ],
    ids=["fp32-16", "fp32-64", "fp16-32", "bf16-32", "fp32-tiled-cb-per-head", "fp16-tiled", "bf16-tiled",
         "bf16-tiled-cb-per-head"],
)
def test_varlen_prefill_matches_reference(triton_on_cpu, dtype, lengths, launch):
    args = _inputs(sum(lengths), dtype)
    cu = cu_seqlens_of(lengths)
    h0 = torch.randn(len(lengths), HEADS, HEAD_DIM, D_STATE)
    h0[1] = 0.0
    y, final = ssd_scan_varlen_triton(**args, cu_seqlens=cu, initial_state=h0, **launch)
    y_ref, final_ref = ssd_scan_ref(**args, cu_seqlens=cu, initial_state=h0)
    assert y.dtype == final.dtype == torch.float32
    torch.testing.assert_close(y, y_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(final, final_ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dt_limit", [(0.0, float("inf")), (0.05, 0.6)], ids=["no-limit", "limit"])
def test_prefill_discretises_dt_in_kernel(triton_on_cpu, dt_limit):
    """Raw dt with Mamba-2's bias, softplus and clamp == the reference on the discretised dt; the Triton and the
    PyTorch paths of ssd_scan_varlen agree. A, D and dt_bias in bf16 are read as fp32."""
    lengths = [70, 1, 33]
    args = _inputs(sum(lengths), torch.float32, seed=5)
    gen = torch.Generator().manual_seed(6)
    args["dt"] = torch.randn(sum(lengths), HEADS, generator=gen) * 3  # softplus's whole range, negative too
    args["A"], args["D"] = args["A"].bfloat16(), args["D"].bfloat16()
    dt_bias = torch.randn(HEADS, generator=gen).bfloat16()
    cu = cu_seqlens_of(lengths)
    h0 = torch.randn(len(lengths), HEADS, HEAD_DIM, D_STATE)
    options = {"dt_bias": dt_bias, "dt_softplus": True, "dt_limit": dt_limit}
    y, final = ssd_scan_varlen_triton(**args, cu_seqlens=cu, initial_state=h0, chunk_size=32, **options)
    discrete = {**args, "dt": discretize_dt(args["dt"], **options), "A": args["A"].float(), "D": args["D"].float()}
    y_ref, final_ref = ssd_scan_ref(**discrete, cu_seqlens=cu, initial_state=h0)
    torch.testing.assert_close(y, y_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(final, final_ref, rtol=1e-4, atol=1e-4)
    if dt_limit[0] > 0:
        assert discrete["dt"].min() == dt_limit[0] and discrete["dt"].max() == dt_limit[1]  # the clamp acts
    with force_triton(False):
        y_torch, final_torch = ssd_scan_varlen(**args, cu_seqlens=cu, initial_state=h0, **options)
    torch.testing.assert_close(y_torch, y_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(final_torch, final_ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "dtype, lengths, launch",
    [(torch.float32, LENGTHS, {}), (torch.float32, TILED_LENGTHS, TILED), (torch.bfloat16, LENGTHS, {}),
     (torch.bfloat16, TILED_LENGTHS, TILED)],
    ids=["default", "tiled", "bf16-default", "bf16-tiled"],
)
def test_prefill_reads_and_writes_pool_slots(triton_on_cpu, dtype, lengths, launch):
    args = _inputs(sum(lengths), dtype, seed=1)
    del args["D"]
    cu = cu_seqlens_of(lengths)
    pool = torch.randn(NUM_SLOTS, 3, HEADS, HEAD_DIM, D_STATE)
    before = pool.clone()
    slots = slot_ids_for(len(lengths), NUM_SLOTS)
    y, returned = ssd_scan_varlen_triton(**args, cu_seqlens=cu, initial_state=pool[:, 2], slot_ids=slots, **launch)
    y_ref, final_ref = ssd_scan_ref(**args, cu_seqlens=cu, initial_state=before[:, 2][slots])
    assert returned.data_ptr() == pool[:, 2].data_ptr()
    torch.testing.assert_close(y, y_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(pool[:, 2][slots], final_ref, rtol=1e-4, atol=1e-4)
    assert_other_rows_untouched(pool, before, slots, 2)


@pytest.mark.parametrize("triton", [True, False], ids=["triton", "copies"])
def test_public_scan_on_pool_slots(triton_on_cpu, triton):
    """ssd_scan_varlen with slot ids and raw dt, as the Mamba-2 block calls it: both paths leave the same pool."""
    lengths = [40, 1, 9]
    args = _inputs(sum(lengths), torch.float32, seed=8)
    cu = cu_seqlens_of(lengths)
    pool = torch.randn(NUM_SLOTS, 2, HEADS, HEAD_DIM, D_STATE)
    before = pool.clone()
    slots = slot_ids_for(len(lengths), NUM_SLOTS, seed=9)
    dt_bias = torch.randn(HEADS)
    with force_triton(triton):
        y, returned = ssd_scan_varlen(**args, cu_seqlens=cu, initial_state=pool[:, 1], chunk_size=16, dt_bias=dt_bias,
                                      dt_softplus=True, slot_ids=slots)
    discrete = {**args, "dt": discretize_dt(args["dt"], dt_bias, dt_softplus=True)}
    y_ref, final_ref = ssd_scan_ref(**discrete, cu_seqlens=cu, initial_state=before[:, 1][slots])
    assert returned.data_ptr() == pool[:, 1].data_ptr()
    torch.testing.assert_close(y, y_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(pool[:, 1][slots], final_ref, rtol=1e-4, atol=1e-4)
    assert_other_rows_untouched(pool, before, slots, 1)


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
