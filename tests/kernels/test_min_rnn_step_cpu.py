"""The fused CPU minGRU / minLSTM decode step == the reference gates + recurrence, in place, any slot order."""

from __future__ import annotations

import pytest
import torch

from rnnserve.kernels.cpu_extension import cpu_ops
from rnnserve.kernels.min_rnn_step import min_rnn_step
from rnnserve.kernels.min_rnn_step.naive import min_rnn_step_ref
from tests.kernels.kernel_cases import slot_ids_for

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
    torch.testing.assert_close(h, h_ref.to(dtype), rtol=2e-6 if dtype == torch.float32 else 2**-8, atol=2e-6)
    torch.testing.assert_close(pool, expected_pool, rtol=2e-6, atol=2e-6)


def test_the_op_rejects_mismatched_shapes() -> None:
    with pytest.raises(RuntimeError, match="3 x 4 columns"):
        torch.ops.rnnserve.min_rnn_step(torch.zeros(1, 8), torch.zeros(2, 4), torch.zeros(1, dtype=torch.long), True)
    with pytest.raises(RuntimeError, match="int64"):
        torch.ops.rnnserve.min_rnn_step(torch.zeros(1, 8), torch.zeros(2, 4), torch.zeros(1, dtype=torch.int32), False)
