"""Fused minGRU / minLSTM decode step == the reference gates + recurrence (interpreter, small sizes)."""

from __future__ import annotations

import pytest
import torch

from rnnserve.kernels.min_rnn_step import min_rnn_step
from rnnserve.kernels.min_rnn_step.naive import min_rnn_step_ref
from tests.kernels.kernel_cases import slot_ids_for

DIM = 40  # not a power of two


@pytest.mark.parametrize("cell, projections", [("mingru", 2), ("minlstm", 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_step_matches_reference_in_place(triton_on_cpu, cell, projections, dtype):
    gen = torch.Generator().manual_seed(0)
    batch, num_slots, layers, layer = 6, 13, 3, 2
    # Wide inputs reach both branches of g and saturate the gates.
    proj = (4 * torch.randn(batch, projections * DIM, generator=gen)).to(dtype)
    pool = torch.rand(num_slots, layers, DIM, generator=gen)
    expected_pool = pool.clone()
    slots = slot_ids_for(batch, num_slots, seed=1)
    h = min_rnn_step(proj, pool[:, layer], slots, cell)
    h_ref = min_rnn_step_ref(proj, expected_pool[slots, layer], cell)
    expected_pool[slots, layer] = h_ref
    assert h.dtype == dtype
    # The output is rounded to ``dtype`` (the interpreter may truncate rather than round: one bf16 ulp).
    out_tol = 2e-6 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(h.float(), h_ref, rtol=out_tol, atol=out_tol)
    torch.testing.assert_close(pool, expected_pool, rtol=2e-6, atol=2e-6)


def test_unknown_cell_is_rejected(triton_on_cpu):
    with pytest.raises(ValueError, match="unknown cell"):
        min_rnn_step(torch.zeros(1, 4), torch.zeros(2, 2), torch.zeros(1, dtype=torch.long), "gru")
