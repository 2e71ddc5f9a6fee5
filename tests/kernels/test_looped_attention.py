"""Attention over a per-slot, per-loop K/V cache (``kernels/cached_attention``): the Triton decode kernel (under
the interpreter), the SDPA prefill and decode paths, all against the reference."""

from __future__ import annotations

import pytest
import torch

from rnnserve.kernels import cached_attention
from rnnserve.kernels.cached_attention import cached_attention_decode, cached_attention_prefill
from rnnserve.kernels.cached_attention.naive import cached_attention_ref
from rnnserve.kernels.cpu_extension import cpu_ops
from tests.kernels.kernel_cases import record_op_calls

SLOTS, LOOPS, CAPACITY, HEADS = 7, 3, 150, 4


def _pools(dim: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (SLOTS + 1, LOOPS, HEADS, CAPACITY, dim)
    return torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)


def _qkv(rows: int, dim: int, dtype: torch.dtype, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(rows, HEADS, dim, generator=g).to(dtype) for _ in range(3)]


@pytest.mark.parametrize("dim", [16, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_triton_decode_matches_reference(triton_on_cpu, dim: int, dtype: torch.dtype) -> None:
    """Out-of-order slots, positions 0 .. capacity-1 (one block, several, a ragged tail), a strided loop view;
    the new keys and values land at each row's position and nowhere else."""
    k_pool, v_pool = _pools(dim, dtype)
    slot_ids = torch.tensor([5, 0, 3, 6, 2])
    positions = torch.tensor([0, 63, 64, 149, 100])
    q, k, v = _qkv(5, dim, dtype)
    loop = 1
    expected_k, expected_v = k_pool.clone(), v_pool.clone()
    expected_k[:, loop][slot_ids, :, positions] = k
    expected_v[:, loop][slot_ids, :, positions] = v
    want = cached_attention_ref(q, expected_k[:, loop], expected_v[:, loop], slot_ids, positions)
    got = cached_attention_decode(q, k, v, k_pool[:, loop], v_pool[:, loop], slot_ids, positions)
    assert got.dtype == torch.float32 and got.shape == (5, HEADS, dim)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    assert torch.equal(k_pool, expected_k) and torch.equal(v_pool, expected_v)


def _assert_poisoned_rows_change_nothing(dtype: torch.dtype) -> None:
    """Poisoned cache rows after a row's position (and in other slots, e.g. the CUDA graphs' scratch slot)
    change nothing in the decode step."""
    k_pool, v_pool = _pools(16, dtype)
    slot_ids, positions = torch.tensor([2, 4]), torch.tensor([10, 70])
    q, k, v = _qkv(2, 16, dtype)
    clean = cached_attention_decode(q, k, v, k_pool[:, 0], v_pool[:, 0], slot_ids, positions)
    k_pool[2, 0, :, 11:], v_pool[2, 0, :, 11:] = float("nan"), float("nan")
    k_pool[4, 0, :, 71:], v_pool[4, 0, :, 71:] = float("inf"), float("nan")
    k_pool[[0, 1, 3]] = float("nan")
    poisoned = cached_attention_decode(q, k, v, k_pool[:, 0], v_pool[:, 0], slot_ids, positions)
    torch.testing.assert_close(poisoned, clean, atol=0, rtol=0)


def test_triton_decode_ignores_rows_past_each_position(triton_on_cpu) -> None:
    _assert_poisoned_rows_change_nothing(torch.float32)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_decode_matches_reference(fused: bool, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """The C++ decode step (spied) and, without it, the per-row SDPA path."""
    if fused and not cpu_ops():
        pytest.skip("needs the fused CPU kernels")
    monkeypatch.setattr(cached_attention, "use_cpu_kernel", lambda x: fused)
    calls = record_op_calls(monkeypatch, torch.ops.rnnserve, "cached_attention_decode") if fused else []
    k_pool, v_pool = _pools(24, dtype)
    slot_ids, positions = torch.tensor([6, 1, 4]), torch.tensor([3, 149, 0])
    q, k, v = _qkv(3, 24, dtype)
    expected_k, expected_v = k_pool.clone(), v_pool.clone()
    expected_k[:, 2][slot_ids, :, positions] = k
    expected_v[:, 2][slot_ids, :, positions] = v
    got = cached_attention_decode(q, k, v, k_pool[:, 2], v_pool[:, 2], slot_ids, positions)
    want = cached_attention_ref(q, expected_k[:, 2], expected_v[:, 2], slot_ids, positions)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    assert torch.equal(k_pool, expected_k) and torch.equal(v_pool, expected_v)  # stored there, nowhere else
    assert len(calls) == int(fused)


@pytest.mark.skipif(not cpu_ops(), reason="needs the fused CPU kernels")
def test_cpu_decode_ignores_rows_past_each_position() -> None:
    _assert_poisoned_rows_change_nothing(torch.bfloat16)
    k_pool, v_pool = _pools(16, torch.bfloat16)
    q = _qkv(2, 16, torch.bfloat16)[0]
    outside = [
        (torch.tensor([2, 4]), torch.tensor([110, 170])),
        (torch.tensor([2, 4]), torch.tensor([3, -1])),
        (torch.tensor([2, 8]), torch.tensor([1, 2])),
    ]
    for slots, positions in outside:  # a position past the capacity or before 0, a slot past the pool
        with pytest.raises(RuntimeError, match="outside the cache"):
            torch.ops.rnnserve.cached_attention_decode(q, q, q, k_pool[:, 0], v_pool[:, 0], slots, positions, 0.25)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_matches_reference(dtype: torch.dtype) -> None:
    """Chunks that start a sequence and chunks that continue one (attending to earlier cache rows)."""
    k_pool, v_pool = _pools(16, dtype)
    slot_ids = torch.tensor([3, 0, 5, 1])
    starts, lengths = (0, 17, 0, 140), (9, 30, 1, 10)
    rows = sum(lengths)
    q, k, v = _qkv(rows, 16, dtype)
    row_slots = torch.repeat_interleave(slot_ids, torch.tensor(lengths))
    row_positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lengths, strict=True)])
    expected_k, expected_v = k_pool.clone(), v_pool.clone()
    expected_k[:, 0][row_slots, :, row_positions] = k
    expected_v[:, 0][row_slots, :, row_positions] = v
    got = cached_attention_prefill(q, k, v, k_pool[:, 0], v_pool[:, 0], slot_ids.tolist(), starts, lengths)
    want = cached_attention_ref(q, expected_k[:, 0], expected_v[:, 0], row_slots, row_positions)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    assert torch.equal(k_pool, expected_k) and torch.equal(v_pool, expected_v)
