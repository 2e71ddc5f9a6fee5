"""The fused CPU minGRU / minLSTM ops: the decode step == the reference gates + recurrence, in place, any slot
order; the prefill scan == the log-space reference and == the step token by token."""

from __future__ import annotations

import pytest
import torch

from rnnserve.kernels.cpu_extension import cpu_ops
from rnnserve.kernels.diag_linear_scan.naive import diag_log_scan_ref
from rnnserve.kernels.min_rnn_step import min_rnn_scan, min_rnn_step
from rnnserve.kernels.min_rnn_step.naive import LOG_COEFFICIENTS, min_rnn_step_ref
from tests.kernels.kernel_cases import LENGTHS, cu_seqlens_of, record_op_calls, slot_ids_for

pytestmark = pytest.mark.skipif(not cpu_ops(), reason="fused CPU kernels could not be built")

DIM = 40  # not a power of two


@pytest.mark.parametrize(("cell", "projections"), [("mingru", 2), ("minlstm", 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch", [1, 6, 37])  # 37 rows: more than one thread task
@torch.inference_mode()
def test_cpu_step_matches_reference_in_place(cell: str, projections: int, dtype: torch.dtype, batch: int) -> None:
    gen = torch.Generator().manual_seed(batch)
    num_slots, layers, layer = batch + 7, 3, 2
    # Wide inputs reach both branches of g and saturate the gates (softplus past its threshold of 20 too).
    proj = (12 * torch.randn(batch, projections * DIM, generator=gen)).to(dtype)
    pool = torch.rand(num_slots, layers, DIM, generator=gen)
    expected_pool = pool.clone()
    slots = slot_ids_for(batch, num_slots, seed=1)
    h = min_rnn_step(proj, pool[:, layer], slots, cell)
    h_ref = min_rnn_step_ref(proj, expected_pool[slots, layer], cell)
    expected_pool[slots, layer] = h_ref
    assert h.dtype == dtype and h.shape == (batch, DIM)
    # The fp32 states agree to 2e-6; a bf16 h is that state rounded, one bf16 step apart where the two fp32 values
    # straddle a rounding boundary.
    torch.testing.assert_close(h, h_ref.to(dtype), rtol=2e-6 if dtype == torch.float32 else 2**-7, atol=2e-6)
    torch.testing.assert_close(pool, expected_pool, rtol=2e-6, atol=2e-6)


def test_the_op_rejects_mismatched_shapes() -> None:
    with pytest.raises(RuntimeError, match="3 x 4 columns"):
        torch.ops.rnnserve.min_rnn_step(torch.zeros(1, 8), torch.zeros(2, 4), torch.zeros(1, dtype=torch.long), True)
    with pytest.raises(RuntimeError, match="int64"):
        torch.ops.rnnserve.min_rnn_step(torch.zeros(1, 8), torch.zeros(2, 4), torch.zeros(1, dtype=torch.int32), False)


@pytest.mark.parametrize(("cell", "projections"), [("mingru", 2), ("minlstm", 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [DIM, 300])  # 300: a second, partial task of 256 channels
@torch.inference_mode()
def test_cpu_scan_matches_log_space_reference_and_the_step(
    monkeypatch: pytest.MonkeyPatch, cell: str, projections: int, dtype: torch.dtype, dim: int
) -> None:
    gen = torch.Generator().manual_seed(dim)
    lengths = [*LENGTHS[:2], 0, *LENGTHS[2:]]
    total = sum(lengths)
    # A strided proj (a view of a wider GEMM output), inputs wide enough to reach both branches of g.
    proj = (6 * torch.randn(total, projections * dim + 5, generator=gen)).to(dtype)[:, : projections * dim]
    h0 = torch.rand(len(lengths), dim, generator=gen)
    kept = h0.clone()
    calls = record_op_calls(monkeypatch, torch.ops.rnnserve, "min_rnn_scan")
    hidden, final = min_rnn_scan(proj, cu_seqlens_of(lengths), h0, cell)
    assert len(calls) == 1 and torch.equal(h0, kept) and hidden.dtype == final.dtype == torch.float32
    log_a, log_b = LOG_COEFFICIENTS[cell](proj)
    hidden_ref, final_ref = diag_log_scan_ref(log_a, log_b, cu_seqlens_of(lengths), kept)
    # Linear against log space (exp of logs): the relative error grows with the states (up to ~20 here).
    torch.testing.assert_close(hidden, hidden_ref, rtol=5e-5, atol=2e-5)
    torch.testing.assert_close(final, final_ref, rtol=5e-5, atol=2e-5)
    # Token by token through the decode op: the same formulas (vectorised differently: within fp32 rounding).
    pool, rows = kept.clone(), torch.arange(len(lengths))
    bounds = cu_seqlens_of(lengths).tolist()
    for position in range(max(lengths)):
        live = [b for b in range(len(lengths)) if position < lengths[b]]
        tokens = torch.tensor([bounds[b] + position for b in live])
        min_rnn_step(proj[tokens].contiguous(), pool, rows[live], cell)
        torch.testing.assert_close(pool[live], hidden[tokens], rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(pool, final, rtol=2e-6, atol=2e-6)


def test_the_scan_rejects_bad_offsets() -> None:
    with pytest.raises(RuntimeError, match="from 0 to T"):
        torch.ops.rnnserve.min_rnn_scan(torch.zeros(3, 8), torch.tensor([0, 2]), torch.zeros(1, 4), False)
    with pytest.raises(RuntimeError, match="must not decrease"):
        torch.ops.rnnserve.min_rnn_scan(torch.zeros(3, 8), torch.tensor([0, 4, 3]), torch.zeros(2, 4), False)
