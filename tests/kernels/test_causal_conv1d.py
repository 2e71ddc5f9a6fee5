"""Triton varlen conv prefill and in-place slot update == the PyTorch reference (interpreter, small sizes)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rnnserve.kernels.backend import force_triton
from rnnserve.kernels.causal_conv1d import causal_conv1d_update, causal_conv1d_varlen
from rnnserve.kernels.causal_conv1d.naive import causal_conv1d_update_ref, causal_conv1d_varlen_ref
from tests.kernels.kernel_cases import LENGTHS, assert_other_rows_untouched, cu_seqlens_of, slot_ids_for

CHANNELS = 20  # not a power of two: exercises the channel mask


def _params(width: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    weight, bias = torch.randn(CHANNELS, width, generator=gen), torch.randn(CHANNELS, generator=gen)
    return weight.to(dtype), bias.to(dtype)


def _tolerance(dtype: torch.dtype) -> dict[str, float]:
    return {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 3e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [2, 4])
@pytest.mark.parametrize("with_state", [True, False])
def test_varlen_matches_reference(triton_on_cpu, dtype, width, with_state):
    gen = torch.Generator().manual_seed(1)
    cu = cu_seqlens_of(LENGTHS)
    x = torch.randn(sum(LENGTHS), CHANNELS, generator=gen).to(dtype)
    weight, bias = _params(width, dtype)
    h0 = torch.randn(len(LENGTHS), CHANNELS, width - 1, generator=gen) if with_state else None
    y, final = causal_conv1d_varlen(x, weight, bias, cu, h0)
    y_ref, final_ref = causal_conv1d_varlen_ref(x, weight, bias, cu, h0)
    assert y.dtype == dtype and final.dtype == final_ref.dtype == torch.float32
    torch.testing.assert_close(y, y_ref, **_tolerance(dtype))
    torch.testing.assert_close(final, final_ref)  # states are copies of inputs: exact


def test_varlen_reads_a_strided_initial_state_without_bias(triton_on_cpu):
    """The model passes ``pool[slots, layer]`` views; a 1-token sequence's tail mixes state and input."""
    gen = torch.Generator().manual_seed(2)
    lengths = [1, 2, 7]
    cu = cu_seqlens_of(lengths)
    x = torch.randn(sum(lengths), CHANNELS, generator=gen)
    weight, _ = _params(4, torch.float32)
    pool = torch.randn(len(lengths), 2, CHANNELS, 3, generator=gen)
    y, final = causal_conv1d_varlen(x, weight, None, cu, pool[:, 1])
    y_ref, final_ref = causal_conv1d_varlen_ref(x, weight, None, cu, pool[:, 1])
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(final, final_ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("triton", [True, False], ids=["triton", "copies"])
def test_varlen_reads_and_writes_pool_slots(triton_on_cpu, dtype, triton):
    """With slot ids the states are rows of one layer's pool view, out of order: read there and overwritten in
    place (a 1-token sequence's final tail is mostly its initial one), every other row untouched. The Triton
    kernel addresses the rows; the other paths gather and scatter copies."""
    gen = torch.Generator().manual_seed(5)
    lengths = [1, 2, 40, 7]
    cu = cu_seqlens_of(lengths)
    x = torch.randn(sum(lengths), CHANNELS, generator=gen).to(dtype)
    weight, bias = _params(4, dtype)
    pool = torch.randn(9, 2, CHANNELS, 3, generator=gen)
    before = pool.clone()
    slots = slot_ids_for(len(lengths), 9, seed=6)
    with force_triton(triton):
        y, returned = causal_conv1d_varlen(x, weight, bias, cu, pool[:, 1], silu=True, slot_ids=slots)
    y_ref, final_ref = causal_conv1d_varlen_ref(x, weight, bias, cu, before[:, 1][slots])
    assert returned.data_ptr() == pool[:, 1].data_ptr()
    torch.testing.assert_close(y, F.silu(y_ref), **_tolerance(dtype))
    torch.testing.assert_close(pool[:, 1][slots], final_ref)
    assert_other_rows_untouched(pool, before, slots, 1)


def test_varlen_first_outputs_of_a_sequence_across_two_tiles(triton_on_cpu):
    """A sequence's first K-1 outputs (which read the initial state) are written apart from the tiles: one that
    starts in a tile's last row has them in two tiles, the second of which holds no sequence start."""
    gen = torch.Generator().manual_seed(4)
    lengths = [15, 40, 30]  # the second sequence starts at row 15, the last row of the first 16-row tile
    cu = cu_seqlens_of(lengths)
    x = torch.randn(sum(lengths), CHANNELS, generator=gen)
    weight, bias = _params(4, torch.float32)
    h0 = torch.randn(len(lengths), CHANNELS, 3, generator=gen)
    y, final = causal_conv1d_varlen(x, weight, bias, cu, h0)
    y_ref, final_ref = causal_conv1d_varlen_ref(x, weight, bias, cu, h0)
    torch.testing.assert_close(y, y_ref, **_tolerance(torch.float32))
    torch.testing.assert_close(final, final_ref)


def test_varlen_reads_strided_rows_in_place_and_fuses_silu(triton_on_cpu):
    """Mamba passes ``x``, a column slice of its in_proj output: rows are read with their stride, not copied."""
    gen = torch.Generator().manual_seed(3)
    cu = cu_seqlens_of(LENGTHS)
    projected = torch.randn(sum(LENGTHS), 2 * CHANNELS + 3, generator=gen)
    x = projected[:, CHANNELS : 2 * CHANNELS]
    weight, bias = _params(4, torch.float32)
    h0 = torch.randn(len(LENGTHS), CHANNELS, 3, generator=gen)
    y, final = causal_conv1d_varlen(x, weight, bias, cu, h0, silu=True)
    y_ref, final_ref = causal_conv1d_varlen_ref(x.contiguous(), weight, bias, cu, h0)
    assert y.is_contiguous()
    torch.testing.assert_close(y, F.silu(y_ref), **_tolerance(torch.float32))
    torch.testing.assert_close(final, final_ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [2, 4])
def test_update_shifts_slots_in_place(triton_on_cpu, dtype, width):
    gen = torch.Generator().manual_seed(3)
    batch, num_slots, layers, layer = 5, 9, 2, 1
    x = torch.randn(batch, CHANNELS, generator=gen).to(dtype)
    weight, bias = _params(width, dtype)
    pool = torch.randn(num_slots, layers, CHANNELS, width - 1, generator=gen)
    expected_pool = pool.clone()
    slots = slot_ids_for(batch, num_slots)
    y = causal_conv1d_update(x, pool[:, layer], weight, bias, slots)
    y_ref, new_state = causal_conv1d_update_ref(x, expected_pool[slots, layer], weight, bias)
    expected_pool[slots, layer] = new_state
    torch.testing.assert_close(y, y_ref, **_tolerance(dtype))
    torch.testing.assert_close(pool, expected_pool)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_update_reads_a_column_slice_and_fuses_silu(triton_on_cpu, dtype):
    """The decode input as a mixer has it: the first half of an in_proj output row, with SiLU in-kernel."""
    gen = torch.Generator().manual_seed(4)
    projected = torch.randn(5, 2 * CHANNELS, generator=gen).to(dtype)
    x = projected[:, :CHANNELS]
    weight, bias = _params(4, dtype)
    pool = torch.randn(9, CHANNELS, 3, generator=gen)
    expected_pool = pool.clone()
    slots = slot_ids_for(5, 9)
    y = causal_conv1d_update(x, pool, weight, bias, slots, silu=True)
    y_ref, new_state = causal_conv1d_update_ref(x.float(), expected_pool[slots], weight.float(), bias.float())
    expected_pool[slots] = new_state
    assert y.is_contiguous() and y.dtype == dtype
    torch.testing.assert_close(y, F.silu(y_ref).to(dtype), **_tolerance(dtype))
    torch.testing.assert_close(pool, expected_pool)


@pytest.mark.parametrize("triton", [True, False], ids=["triton", "cpu"])
def test_width_one_keeps_no_state(triton_on_cpu, triton):
    """A conv of width 1 (an ablation some checkpoints ship) has an empty tail: each path computes ``x w + b``
    and writes no state (the update once wrote one column into zero, failing every decode step)."""
    gen = torch.Generator().manual_seed(3)
    weight, bias = _params(1, torch.float32)
    pool = torch.empty(6, CHANNELS, 0)
    slots = torch.tensor([4, 1])
    x = torch.randn(2, CHANNELS, generator=gen)
    with force_triton(triton):
        y = causal_conv1d_update(x, pool, weight, bias, slots)
        y_varlen, final = causal_conv1d_varlen(x, weight, bias, cu_seqlens_of([1, 1]), pool, slot_ids=slots)
    torch.testing.assert_close(y, x * weight[:, 0] + bias)
    torch.testing.assert_close(y_varlen, y)
    assert final.shape[-1] == 0
