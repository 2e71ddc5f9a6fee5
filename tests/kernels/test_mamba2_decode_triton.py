"""The Triton Mamba-2 decode stack (three kernels a layer) == the op-by-op reference, under the interpreter."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from rnnserve.engine.models.base import DecodeBatch
from rnnserve.engine.models.mamba2 import Mamba2Config, Mamba2LM
from rnnserve.kernels import mamba2_decode as mamba2_decode_ops
from rnnserve.kernels.causal_conv1d.naive import causal_conv1d_update_ref
from rnnserve.kernels.mamba2_decode.naive import mamba2_mixer_step_ref
from rnnserve.kernels.residual_rms_norm.naive import residual_rms_norm_ref
from tests.kernels.kernel_cases import count_calls, twin_pools
from tests.kernels.test_mamba_decode_triton import assert_near

# Two heads' channels per SSM program block (head_dim 32 = 2 x 16), two B/C groups, and an in_proj of 324 rows,
# so in_proj blocks straddle the z / xBC / dt sections and the last one is partial.
D_MODEL, HEADS, HEAD_DIM, D_STATE, GROUPS, WIDTH, LAYERS = 48, 4, 32, 16, 2, 4, 3
D_INNER = HEADS * HEAD_DIM
CONV_DIM = D_INNER + 2 * GROUPS * D_STATE


def stack_args(dtype: torch.dtype, batch: int, use_bias: bool, seed: int = 0) -> dict:
    """Random layers as the model holds them (every parameter in ``dtype``), pools with non-zero states and slot
    ids out of order with gaps."""
    g = torch.Generator().manual_seed(seed)

    def weight(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) / shape[-1] ** 0.5).to(dtype)

    def bias(n: int) -> torch.Tensor | None:
        return (torch.randn(n, generator=g) * 0.1).to(dtype) if use_bias else None

    def vector(n: int, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
        return (torch.randn(n, generator=g) * scale + shift).to(dtype)

    layers = [
        (weight(D_INNER + CONV_DIM + HEADS, D_MODEL), bias(D_INNER + CONV_DIM + HEADS),
         (torch.randn(CONV_DIM, WIDTH, generator=g) / 2).to(dtype), bias(CONV_DIM), vector(HEADS, 0.5, -3),
         vector(HEADS, 0.5), vector(HEADS), vector(D_INNER, 0.1, 1), weight(D_MODEL, D_INNER), bias(D_MODEL))
        for _ in range(LAYERS)
    ]  # fmt: skip
    slots = batch + 5
    return {
        "norm_weights": [vector(D_MODEL, 0.1, 1) for _ in range(LAYERS)],
        "layers": layers,
        "conv_pool": torch.randn(slots, LAYERS, CONV_DIM, WIDTH - 1, generator=g),
        "ssm_pool": torch.randn(slots, LAYERS, HEADS, HEAD_DIM, D_STATE, generator=g),
        "slot_ids": torch.randperm(slots - 1, generator=g)[:batch] + 1,
    }


def reference_stack(normed, stream, norm_weights, eps, layers, conv_pool, ssm_pool, slot_ids, dt_limits):
    """The model's op-by-op step from the ops' references."""
    for i, (in_w, in_b, conv_w, conv_b, dt_bias, A_log, D, gated_w, out_w, out_b) in enumerate(layers):
        z, xbc, dt = F.linear(normed, in_w, in_b).split([D_INNER, CONV_DIM, HEADS], dim=-1)
        xbc, tail = causal_conv1d_update_ref(xbc, conv_pool[:, i][slot_ids], conv_w, conv_b)
        conv_pool[:, i][slot_ids] = tail
        y = mamba2_mixer_step_ref(xbc, dt, z, ssm_pool[:, i], slot_ids, dt_bias, A_log, D, gated_w, GROUPS, eps,
                                  *dt_limits)  # fmt: skip
        normed, stream = residual_rms_norm_ref(stream, F.linear(y, out_w, out_b), norm_weights[i], eps,
                                               i + 1 < len(layers))  # fmt: skip
    return normed


@pytest.mark.parametrize(("dtype", "stream_dtype"), [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                                     (torch.bfloat16, torch.bfloat16)])  # fmt: skip
@pytest.mark.parametrize("batch", [1, 5])  # 5 rows: padded to a block of 8
@pytest.mark.parametrize(("use_bias", "dt_limits"), [(False, (0.0, math.inf)), (True, (1e-3, 0.05))])
@torch.inference_mode()
def test_stack_matches_reference(triton_on_cpu, dtype, stream_dtype, batch, use_bias, dt_limits) -> None:
    check_stack(dtype, stream_dtype, batch, use_bias, dt_limits)


@pytest.mark.parametrize("early", [False, True])
@torch.inference_mode()
def test_stack_with_several_tiles_matches_reference(triton_on_cpu, monkeypatch, early) -> None:
    """Tiles smaller than a weight row (3 K steps in in_proj, 8 in out_proj): the loops past the first tile,
    which the kernels load apart from the rest, with ``EARLY_LOADS`` on (before the wait) and off."""
    from rnnserve.kernels.mamba2_decode import fused_recurrent
    from rnnserve.kernels.mamba_decode.fused_recurrent import gemv_blocks

    monkeypatch.setattr(fused_recurrent, "TILE", 256)
    monkeypatch.setattr(fused_recurrent, "OUT_PROJ_TILE", 256)
    monkeypatch.setattr(fused_recurrent, "EARLY_LOADS", early)
    assert gemv_blocks(8, D_MODEL, fused_recurrent.IN_PROJ_ROWS, 256)[1] == 16
    assert gemv_blocks(8, D_INNER, fused_recurrent.OUT_PROJ_ROWS, 256)[1] == 16
    check_stack(torch.float32, torch.float32, 5, True, (1e-3, 0.05))


def check_stack(
    dtype: torch.dtype, stream_dtype: torch.dtype, batch: int, use_bias: bool, dt_limits: tuple[float, float]
) -> None:
    """Two steps of the Triton stack against the op-by-op reference: outputs, and the pools' slots (the others
    untouched)."""
    from rnnserve.kernels.mamba2_decode.fused_recurrent import mamba2_decode_stack_triton

    args = stack_args(dtype, batch, use_bias)
    ref_pools = {name: args[name].clone() for name in ("conv_pool", "ssm_pool")}
    conv_before = args["conv_pool"].clone()
    eps = 1e-5
    for step in range(2):
        g = torch.Generator().manual_seed(10 + step)
        normed = torch.randn(batch, D_MODEL, generator=g).to(dtype)
        stream = torch.randn(batch, D_MODEL, generator=g).to(stream_dtype)
        out = mamba2_decode_stack_triton(normed, stream, args["norm_weights"], eps, args["layers"], args["conv_pool"],
                                         args["ssm_pool"], args["slot_ids"], GROUPS, eps, dt_limits)  # fmt: skip
        expected = reference_stack(normed, stream, args["norm_weights"], eps, args["layers"], ref_pools["conv_pool"],
                                   ref_pools["ssm_pool"], args["slot_ids"], dt_limits)  # fmt: skip
        assert out.dtype == expected.dtype == dtype
        assert_near(out, expected, dtype)
    assert_near(args["conv_pool"], ref_pools["conv_pool"], dtype)
    assert_near(args["ssm_pool"], ref_pools["ssm_pool"], dtype)
    untouched = torch.ones(args["conv_pool"].shape[0], dtype=torch.bool)
    untouched[args["slot_ids"]] = False
    assert torch.equal(args["conv_pool"][untouched], conv_before[untouched])


@pytest.mark.parametrize("batch", [2, 5])
@torch.inference_mode()
def test_model_decode_runs_the_stack_for_small_batches(triton_on_cpu, monkeypatch, batch) -> None:
    """With Triton, a decode batch of at most STACK_MAX_BATCH runs the stack (logits and states == the op-by-op
    Triton step); a larger one, or ``STACK_ENABLED`` cleared, the op-by-op step."""
    config = Mamba2Config(vocab_size=64, d_model=D_MODEL, n_layers=2, n_heads=HEADS, head_dim=HEAD_DIM,
                          d_state=D_STATE, n_groups=GROUPS, use_bias=True, dt_max_limit=0.08)  # fmt: skip
    model = Mamba2LM(config).eval()
    model.init_weights(torch.Generator().manual_seed(0))
    calls = count_calls(monkeypatch, [("rnnserve.kernels.mamba2_decode.fused_recurrent", "mamba2_decode_stack_triton"),
                                      ("rnnserve.kernels.ssd.fused_recurrent", "ssd_state_update_triton")])  # fmt: skip
    pools = twin_pools(model, batch + 3)
    slots = (torch.randperm(batch + 2, generator=torch.Generator().manual_seed(2))[:batch] + 1).tolist()
    decode = DecodeBatch.build(list(range(batch)), slots, [4] * batch)
    stacked = model.decode(decode, pools[0].tensors)
    monkeypatch.setattr(mamba2_decode_ops, "STACK_ENABLED", False)
    looped = model.decode(decode, pools[1].tensors)
    small = batch <= mamba2_decode_ops.STACK_MAX_BATCH
    assert calls == {"mamba2_decode_stack_triton": int(small), "ssd_state_update_triton": 2 * (2 - small)}
    torch.testing.assert_close(stacked, looped, rtol=1e-4, atol=1e-4)
    for name in pools[0].tensors:
        torch.testing.assert_close(pools[0].tensors[name], pools[1].tensors[name], rtol=1e-4, atol=1e-4)
