"""The CPU Mamba-2 decode update == the PyTorch update, in place, for slot ids and slices, grouped B/C."""

from __future__ import annotations

import pytest
import torch

from rnnserve.kernels.cpu_extension import cpu_ops
from rnnserve.kernels.ssd import _cpu_op_applies, ssd_state_update
from rnnserve.kernels.ssd.torch_recurrent import ssd_state_update_torch
from tests.kernels.kernel_cases import slot_ids_for

pytestmark = pytest.mark.skipif(not cpu_ops(), reason="fused CPU kernels could not be built")

HEADS, HEAD_DIM, D_STATE = 6, 12, 20


def inputs(batch: int, groups: int, dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    xbc = torch.randn(batch, HEADS * HEAD_DIM + 2 * groups * D_STATE, generator=g).to(dtype)
    x, B, C = xbc.split([HEADS * HEAD_DIM, groups * D_STATE, groups * D_STATE], dim=-1)  # strided, as the model
    return {
        "x": x.unflatten(-1, (HEADS, HEAD_DIM)),
        "dt": torch.rand(batch, HEADS, generator=g) * 0.5,
        "A": -torch.rand(HEADS, generator=g) * 4,
        "B": B.unflatten(-1, (groups, D_STATE)),
        "C": C.unflatten(-1, (groups, D_STATE)),
        "D": torch.randn(HEADS, generator=g).to(dtype),
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("groups", [1, 3])
@pytest.mark.parametrize("batch", [1, 5])
@pytest.mark.parametrize("consecutive", [False, True])
@torch.inference_mode()
def test_cpu_update_matches_torch(dtype: torch.dtype, groups: int, batch: int, consecutive: bool) -> None:
    num_slots, layers, layer = batch + 6, 2, 1
    pool = torch.randn(num_slots, layers, HEADS, HEAD_DIM, D_STATE, generator=torch.Generator().manual_seed(9))
    expected = pool.clone()
    slot_ids = torch.arange(2, 2 + batch) if consecutive else slot_ids_for(batch, num_slots, seed=3)
    slots = slice(2, 2 + batch) if consecutive else slot_ids
    args = inputs(batch, groups, dtype, seed=batch + groups)
    assert _cpu_op_applies(pool[:, layer], args["x"], args["dt"], args["A"], args["B"], args["C"])
    for _ in range(2):  # the second step starts from the first one's states
        y = ssd_state_update(pool[:, layer], slots, **args)
        y_ref = ssd_state_update_torch(expected[:, layer], slots, **args)
        assert y.dtype == torch.float32 and y.shape == (batch, HEADS, HEAD_DIM)
        torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(pool, expected, rtol=1e-5, atol=1e-5)
