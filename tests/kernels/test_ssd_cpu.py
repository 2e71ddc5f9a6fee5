"""The CPU Mamba-2 kernels: the decode update == the PyTorch update, in place, for slot ids and slices, grouped
B/C; the varlen prefill == the token-by-token reference, on pool slots out of order or on a batch's own states."""

from __future__ import annotations

import pytest
import torch

from rnnserve.kernels.cpu_extension import cpu_ops
from rnnserve.kernels.ssd import _cpu_op_applies, _cpu_scan_applies, ssd_scan_varlen, ssd_state_update
from rnnserve.kernels.ssd.naive import ssd_scan_ref
from rnnserve.kernels.ssd.torch_recurrent import ssd_state_update_torch
from tests.kernels.kernel_cases import LENGTHS, cu_seqlens_of, record_op_calls, slot_ids_for

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


def prefill_inputs(lengths: list[int], heads: int, head_dim: int, groups: int, d_state: int, dtype: torch.dtype,
                   seed: int) -> dict[str, torch.Tensor]:
    """Packed inputs as the model passes them: x, B and C strided views of one conv output."""
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    xbc = torch.randn(total, heads * head_dim + 2 * groups * d_state, generator=g).to(dtype)
    x, B, C = xbc.split([heads * head_dim, groups * d_state, groups * d_state], dim=-1)
    return {
        "x": x.unflatten(-1, (heads, head_dim)),
        "dt": torch.rand(total, heads, generator=g) * 0.5,
        "A": -torch.rand(heads, generator=g) * 4,
        "B": B.unflatten(-1, (groups, d_state)),
        "C": C.unflatten(-1, (groups, d_state)),
        "cu_seqlens": cu_seqlens_of(lengths),
        "D": torch.randn(heads, generator=g).to(dtype),
    }


# head_dim 80 under AVX-512 (40 under AVX2 is still past one task's 32): a second, partial block of channels;
# d_state 21: an odd state size; LENGTHS: odd and even lengths (tokens go in pairs), and a sequence of 0 tokens.
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("heads", "head_dim", "groups", "d_state"), [(6, 12, 3, 20), (2, 80, 1, 21)])
@torch.inference_mode()
def test_cpu_prefill_on_pool_slots_matches_reference(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, heads: int,
                                                     head_dim: int, groups: int, d_state: int) -> None:
    lengths = [*LENGTHS[:3], 0, *LENGTHS[3:]]
    args = prefill_inputs(lengths, heads, head_dim, groups, d_state, dtype, seed=head_dim + groups)
    num_slots, layers, layer = len(lengths) + 4, 2, 1
    pool = torch.randn(num_slots, layers, heads, head_dim, d_state, generator=torch.Generator().manual_seed(5))
    before = pool.clone()
    slot_ids = slot_ids_for(len(lengths), num_slots, seed=2)
    assert _cpu_scan_applies(args["x"], args["B"], args["C"], pool[:, layer], slot_ids)
    calls = record_op_calls(monkeypatch, torch.ops.rnnserve, "ssd_scan_varlen")
    y, final = ssd_scan_varlen(**args, initial_state=pool[:, layer], slot_ids=slot_ids)
    assert len(calls) == 1 and final.data_ptr() == pool[:, layer].data_ptr()
    y_ref, final_ref = ssd_scan_ref(**args, initial_state=before[slot_ids, layer])
    tolerance = 1e-5 if dtype == torch.float32 else 2e-5  # fp32 arithmetic on the same rounded inputs
    torch.testing.assert_close(y, y_ref, rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(pool[slot_ids, layer], final_ref, rtol=tolerance, atol=tolerance)
    untouched = torch.ones(num_slots, dtype=torch.bool)
    untouched[slot_ids] = False
    assert torch.equal(pool[untouched], before[untouched]) and torch.equal(pool[:, 0], before[:, 0])


@pytest.mark.parametrize("initial", [False, True])
@torch.inference_mode()
def test_cpu_prefill_of_a_batch_matches_reference(initial: bool) -> None:
    lengths = [3, 17, 1]
    args = prefill_inputs(lengths, 4, 16, 2, 8, torch.float32, seed=11)
    h0 = torch.randn(len(lengths), 4, 16, 8, generator=torch.Generator().manual_seed(1)) if initial else None
    kept = None if h0 is None else h0.clone()
    y, final = ssd_scan_varlen(**args, initial_state=h0)
    y_ref, final_ref = ssd_scan_ref(**args, initial_state=kept)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(final, final_ref, rtol=1e-5, atol=1e-5)
    assert h0 is None or torch.equal(h0, kept)  # the caller's initial states are not written


def test_cpu_prefill_checks_its_inputs() -> None:
    args = prefill_inputs([2, 3], 2, 4, 1, 8, torch.float32, seed=0)
    pool, slots = torch.zeros(4, 2, 4, 8), torch.tensor([0, 1])
    op_args = [args["x"], args["dt"], args["A"], args["B"], args["C"], args["D"], args["cu_seqlens"]]
    with pytest.raises(RuntimeError, match="slot id out of range"):
        torch.ops.rnnserve.ssd_scan_varlen(*op_args, pool, torch.tensor([0, 4]))
    with pytest.raises(RuntimeError, match="cu_seqlens must run from 0 to T"):
        op_args[6] = torch.tensor([0, 2, 4])
        torch.ops.rnnserve.ssd_scan_varlen(*op_args, pool, slots)
