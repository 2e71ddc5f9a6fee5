"""The C++ RG-LRU ops == the reference (the Hugging Face model's ops, each rounded in the activations' dtype):
the varlen prefill scan against the reference's coefficients and scan, the decode step in place on pool slots."""

from __future__ import annotations

import pytest
import torch

from rnnserve.kernels.cpu_extension import cpu_ops
from rnnserve.kernels.diag_linear_scan.naive import diag_linear_scan_ref
from rnnserve.kernels.rg_lru import rg_lru_scan, rg_lru_step
from rnnserve.kernels.rg_lru.naive import rg_lru_coefficients, rg_lru_step_ref
from tests.kernels.kernel_cases import LENGTHS, cu_seqlens_of, record_op_calls, slot_ids_for

pytestmark = pytest.mark.skipif(not cpu_ops(), reason="fused CPU kernels could not be built")

HEADS, WIDTH = 3, 100  # 300 channels: a second, partial prefill task of 256; a width that is not a power of two
DIM = HEADS * WIDTH


def gate_weights(dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return (
        (torch.randn(HEADS, WIDTH, WIDTH, generator=g) / WIDTH**0.5).to(dtype),
        (torch.randn(HEADS, WIDTH, generator=g) * 0.1).to(dtype),
        (torch.randn(HEADS, WIDTH, WIDTH, generator=g) / WIDTH**0.5).to(dtype),
        (torch.randn(HEADS, WIDTH, generator=g) * 0.1).to(dtype),
        torch.randn(DIM, generator=g).to(dtype),
    )


def assert_matches(got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """fp32 to rounding; bf16 with each op rounded as the reference rounds it: equal but for the rare value whose
    fp32 result lies within an fp32 unit of a bf16 rounding boundary (the exps and roots are not torch's)."""
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(got.float(), expected.float(), rtol=2**-6, atol=2**-6)
        assert (got != expected).float().mean() < 0.01


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.inference_mode()
def test_cpu_scan_matches_reference(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(3)
    lengths = [*LENGTHS[:2], 0, *LENGTHS[2:]]
    cu = cu_seqlens_of(lengths)
    x = torch.randn(sum(lengths), DIM, generator=g).to(dtype)
    # Sequences start at their first token, except the second and the last, chunks that continue a sequence.
    first = torch.zeros(sum(lengths), dtype=torch.bool)
    first[cu[:-1][torch.tensor(lengths) > 0]] = True
    first[cu[1]] = first[cu[-2]] = False
    h0 = torch.rand(len(lengths), DIM, generator=g)
    kept = h0.clone()
    weights = gate_weights(dtype, seed=4)
    calls = record_op_calls(monkeypatch, torch.ops.rnnserve, "rg_lru_scan")
    h, final = rg_lru_scan(x, first, cu, h0, *weights)
    assert len(calls) == 1 and torch.equal(h0, kept) and h.dtype == final.dtype == torch.float32
    a, b = rg_lru_coefficients(x, first, *weights)
    h_ref, final_ref = diag_linear_scan_ref(a, b, cu, kept)
    assert_matches(h.to(dtype), h_ref.to(dtype), dtype)
    assert_matches(final.to(dtype), final_ref.to(dtype), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch", [1, 6])
@torch.inference_mode()
def test_cpu_step_matches_reference_in_place(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, batch: int) -> None:
    g = torch.Generator().manual_seed(batch)
    num_slots, layers, layer = batch + 5, 3, 1
    pool = torch.rand(num_slots, layers, DIM, generator=g)
    expected_pool = pool.clone()
    slots = slot_ids_for(batch, num_slots, seed=2)
    weights = gate_weights(dtype, seed=batch + 7)
    calls = record_op_calls(monkeypatch, torch.ops.rnnserve, "rg_lru_step")
    for step in range(2):  # the second step starts from the first one's states
        x = torch.randn(batch, DIM, generator=g).to(dtype)
        y = torch.randn(batch, DIM, generator=g).to(dtype)
        first = (torch.arange(batch) % 3 == 1) & (step == 0)
        out = rg_lru_step(x, y, first, *weights, pool[:, layer], slots)
        expected = rg_lru_step_ref(x, y, first, *weights, expected_pool[:, layer], slots)
        assert out.dtype == dtype and len(calls) == step + 1
        assert_matches(out, expected, dtype)
        assert_matches(pool.to(dtype), expected_pool.to(dtype), dtype)
    untouched = torch.ones(num_slots, dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(pool[untouched], expected_pool[untouched])


def test_the_ops_check_their_inputs() -> None:
    x, pre = torch.zeros(2, 8), torch.zeros(2, 2, 4)
    softplus, first, pool = torch.zeros(8), torch.zeros(2, dtype=torch.bool), torch.zeros(3, 8)
    with pytest.raises(RuntimeError, match="from 0 to T"):
        torch.ops.rnnserve.rg_lru_scan(x, pre, pre, softplus, first, torch.tensor([0, 3]), torch.zeros(1, 8))
    with pytest.raises(RuntimeError, match="slot id out of range"):
        torch.ops.rnnserve.rg_lru_step(x, x, pre, pre, softplus, first, pool, torch.tensor([0, 3]))
    with pytest.raises(RuntimeError, match="x's dtype"):
        torch.ops.rnnserve.rg_lru_step(x, x, pre.bfloat16(), pre, softplus, first, pool, torch.tensor([0, 1]))
