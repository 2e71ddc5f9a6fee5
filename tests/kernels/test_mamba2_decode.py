"""The fused Mamba-2 mixer step (SiLU, dt discretisation, SSD state update, gated group norm) equals its
PyTorch reference on the output and the updated pool rows, for slots out of order, B/C groups, in_proj-slice
strides and both activation dtypes; the model's decode takes it on CPU and agrees with its op-by-op step."""

from __future__ import annotations

import pytest
import torch

from rnnserve.engine.loader import build_random
from rnnserve.engine.models import mamba2 as mamba2_module
from rnnserve.engine.models.base import DecodeBatch
from rnnserve.engine.state_pool import StatePool
from rnnserve.kernels.cpu_extension import cpu_ops
from rnnserve.kernels.mamba2_decode import mamba2_mixer_step, mamba2_mixer_step_applies
from rnnserve.kernels.mamba2_decode.naive import mamba2_mixer_step_ref

pytestmark = pytest.mark.skipif(not cpu_ops(), reason="fused CPU kernels could not be built")


def step_args(dtype: torch.dtype, batch: int, groups: int, dt_max: float) -> dict:
    heads, head_dim, d_state = 4, 8, 16
    d_inner = heads * head_dim
    conv_dim = d_inner + 2 * groups * d_state
    g = torch.Generator().manual_seed(batch * 10 + groups)
    slots = batch + 3
    projected = torch.randn(batch, d_inner + conv_dim + heads, generator=g).to(dtype)  # in_proj's output
    return {
        "xbc": torch.randn(batch, conv_dim, generator=g).to(dtype),
        "dt_raw": projected[:, -heads:] * 3,
        "z": projected[:, :d_inner],
        "pool": torch.randn(slots, heads, head_dim, d_state, generator=g),
        "slot_ids": torch.randperm(slots, generator=g)[:batch],
        "dt_bias": (torch.rand(heads, generator=g) - 3).to(dtype),
        "A_log": torch.rand(heads, generator=g).to(dtype),
        "D": torch.randn(heads, generator=g).to(dtype),
        "norm_weight": (1 + torch.randn(d_inner, generator=g) / 4).to(dtype),
        "groups": groups,
        "eps": 1e-5,
        "dt_min": 0.0,
        "dt_max": dt_max,
    }


def clone(args: dict) -> dict:
    return {name: t.clone() if isinstance(t, torch.Tensor) else t for name, t in args.items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch", [1, 5])
@pytest.mark.parametrize("groups", [1, 2])
@torch.inference_mode()
def test_fused_step_matches_the_reference(dtype: torch.dtype, batch: int, groups: int) -> None:
    args = step_args(dtype, batch, groups, dt_max=float("inf"))
    assert args["z"].stride(0) != args["z"].shape[1]  # a slice of in_proj's output, as the model passes it
    assert mamba2_mixer_step_applies(args["xbc"], args["dt_raw"], args["z"], args["pool"], args["norm_weight"])
    ref_args = clone(args)
    out = mamba2_mixer_step(**args)
    expected = mamba2_mixer_step_ref(**ref_args)
    assert out.dtype == dtype and out.shape == expected.shape
    untouched = torch.ones(args["pool"].shape[0], dtype=torch.bool)
    untouched[args["slot_ids"]] = False
    assert torch.equal(args["pool"][untouched], ref_args["pool"][untouched])
    torch.testing.assert_close(args["pool"], ref_args["pool"], rtol=1e-5, atol=1e-5)
    if dtype == torch.float32:
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    else:  # one bf16 rounding of the normalised value and one of the weighted product
        torch.testing.assert_close(out.float(), expected.float(), rtol=2**-6, atol=2**-6)


@torch.inference_mode()
def test_dt_is_clamped_to_the_limits() -> None:
    args = step_args(torch.float32, 3, 1, dt_max=0.05)
    ref_args = clone(args)
    unclamped = clone(args)
    unclamped["dt_max"] = float("inf")
    out = mamba2_mixer_step(**args)
    torch.testing.assert_close(out, mamba2_mixer_step_ref(**ref_args), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(out, mamba2_mixer_step(**unclamped))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3])
@torch.inference_mode()
def test_model_decode_takes_the_fused_step_and_matches_the_op_by_op_step(
    dtype: torch.dtype, rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every row checked: the op once read the state update's output after freeing it, which corrupted some
    rows of some batches only, depending on where the allocator put the next buffers."""
    model, _ = build_random("mamba2-tiny", torch.device("cpu"), dtype, seed=1)
    pools = [StatePool(model.state_spec(), 6, torch.device("cpu")) for _ in range(2)]
    g = torch.Generator().manual_seed(0)
    for name, tensor in pools[0].tensors.items():
        tensor.copy_(torch.randn(tensor.shape, generator=g))
        pools[1].tensors[name].copy_(tensor)
    batch = DecodeBatch.build([5, 17, 300][:rows], [4, 0, 2][:rows], [9, 3, 40][:rows], torch.device("cpu"))
    calls = []
    real_step = mamba2_module.mamba2_mixer_step
    monkeypatch.setattr(mamba2_module, "mamba2_mixer_step", lambda *a: calls.append(1) or real_step(*a))
    fused = model.decode(batch, pools[0].tensors)
    assert len(calls) == model.config.n_layers
    monkeypatch.setattr(mamba2_module, "mamba2_mixer_step_applies", lambda *_: False)
    op_by_op = model.decode(batch, pools[1].tensors)
    tolerance = {"rtol": 1e-4, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 0.05, "atol": 0.05}
    torch.testing.assert_close(fused.float(), op_by_op.float(), **tolerance)
    for name, tensor in pools[0].tensors.items():
        torch.testing.assert_close(tensor, pools[1].tensors[name], **tolerance)
