"""The Triton Mamba-1 decode stack (three kernels a layer) == the op-by-op reference, under the interpreter."""

from __future__ import annotations

import pytest
import torch

from rnnserve.engine.models.base import DecodeBatch
from rnnserve.engine.models.mamba import MambaConfig, MambaLM
from rnnserve.kernels import mamba_decode as mamba_decode_ops
from rnnserve.kernels.mamba_decode import mamba_decode_triton_applies
from rnnserve.kernels.mamba_decode.naive import mamba_mixer_decode_ref
from rnnserve.kernels.residual_rms_norm.naive import residual_rms_norm_ref
from tests.kernels.kernel_cases import count_calls, twin_pools

D_MODEL, D_INNER, D_STATE, DT_RANK, WIDTH, LAYERS = 48, 96, 16, 3, 4, 3


def stack_args(dtype: torch.dtype, batch: int, use_bias: bool, stream_dtype: torch.dtype, seed: int = 0) -> dict:
    """Random weights for ``LAYERS`` layers (projections in ``dtype``, the rest fp32), pools with non-zero
    states and slot ids out of order with gaps."""
    g = torch.Generator().manual_seed(seed)

    def weight(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) / shape[-1] ** 0.5).to(dtype)

    def bias(n: int) -> torch.Tensor | None:
        return (torch.randn(n, generator=g) * 0.1).to(dtype) if use_bias else None

    layers = [
        (weight(2 * D_INNER, D_MODEL), bias(2 * D_INNER), torch.randn(D_INNER, WIDTH, generator=g) / 2,
         torch.randn(D_INNER, generator=g) * 0.1 if use_bias else None, weight(DT_RANK + 2 * D_STATE, D_INNER),
         weight(D_INNER, DT_RANK), torch.rand(D_INNER, generator=g) - 4,
         -torch.rand(D_INNER, D_STATE, generator=g) * 4, torch.randn(D_INNER, generator=g),
         weight(D_MODEL, D_INNER), bias(D_MODEL), None, None, None)
        for _ in range(LAYERS)
    ]  # fmt: skip
    slots = batch + 5
    return {
        "normed": torch.randn(batch, D_MODEL, generator=g).to(dtype),
        "stream": torch.randn(batch, D_MODEL, generator=g).to(stream_dtype),
        "norm_weights": [(1 + 0.1 * torch.randn(D_MODEL, generator=g)).to(dtype) for _ in range(LAYERS)],
        "eps": 1e-5,
        "layers": layers,
        "conv_pool": torch.randn(slots, LAYERS, D_INNER, WIDTH - 1, generator=g),
        "ssm_pool": torch.randn(slots, LAYERS, D_INNER, D_STATE, generator=g),
        "slot_ids": torch.randperm(slots - 1, generator=g)[:batch] + 1,
    }


def reference_stack(normed, stream, norm_weights, eps, layers, conv_pool, ssm_pool, slot_ids) -> torch.Tensor:
    """The model's op-by-op step: each layer's reference mixer, then the residual add and the next norm."""
    for i, layer in enumerate(layers):
        in_w, in_b, conv_w, conv_b, x_w, dt_w, dt_b, A, D, out_w, out_b = layer[:11]
        out = mamba_mixer_decode_ref(normed, in_w, in_b, conv_pool[:, i], conv_w, conv_b, slot_ids, x_w, dt_w, dt_b,
                                     A, D, ssm_pool[:, i], out_w, out_b)
        normed, stream = residual_rms_norm_ref(stream, out, norm_weights[i], eps, i + 1 < len(layers))
    return normed


def assert_near(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """fp32: elementwise to 1e-4. bf16: the interpreter rounds fp32 to bf16 toward zero (a GPU to nearest), so
    each of the step's roundings is off by up to one unit and the differences grow through the layers; the
    whole tensor must agree to 3% (the reference itself is ~0.5% from an fp32 run; a wrong index or a missed
    term is far off)."""
    if dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4)
    else:
        error = (actual.float() - expected.float()).norm() / expected.float().norm()
        assert error < 3e-2, error


@pytest.mark.parametrize(("dtype", "stream_dtype"), [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                                     (torch.bfloat16, torch.bfloat16)])  # fmt: skip
@pytest.mark.parametrize("batch", [1, 5])  # 5 rows: padded to a block of 8
@pytest.mark.parametrize("use_bias", [False, True])
@torch.inference_mode()
def test_stack_matches_reference(triton_on_cpu, dtype, stream_dtype, batch, use_bias) -> None:
    check_stack(dtype, stream_dtype, batch, use_bias)


@pytest.mark.parametrize("early", [False, True])
@torch.inference_mode()
def test_stack_with_several_tiles_matches_reference(triton_on_cpu, monkeypatch, early) -> None:
    """Tiles smaller than a weight row (3 K steps in in_proj, 6 in out_proj, 3 x_proj blocks, the last one
    partial): the loops past the first tile, which the kernels load apart from the rest, with ``EARLY_LOADS`` on
    (before the wait) and off."""
    from rnnserve.kernels.mamba_decode import fused_recurrent

    monkeypatch.setattr(fused_recurrent, "TILE", 512)
    monkeypatch.setattr(fused_recurrent, "OUT_PROJ_TILE", 512)
    monkeypatch.setattr(fused_recurrent, "OUT_PROJ_ROWS", 8)
    monkeypatch.setattr(fused_recurrent, "EARLY_LOADS", early)
    assert fused_recurrent.in_proj_blocks(8, D_MODEL, D_INNER, DT_RANK + 2 * D_STATE) == (32, 16, 16)
    assert fused_recurrent.gemv_blocks(8, D_INNER, fused_recurrent.OUT_PROJ_ROWS, 512) == (8, 16)
    check_stack(torch.float32, torch.float32, 5, True)


def check_stack(dtype: torch.dtype, stream_dtype: torch.dtype, batch: int, use_bias: bool) -> None:
    """Two steps of the Triton stack against the op-by-op reference: outputs, and the pools' slots (the others
    untouched)."""
    from rnnserve.kernels.mamba_decode.fused_recurrent import mamba_decode_stack_triton

    args = stack_args(dtype, batch, use_bias, stream_dtype)
    ref = {k: [t.clone() if isinstance(t, torch.Tensor) else t for t in v] if k == "norm_weights" else
           (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in args.items()}  # fmt: skip
    conv_before = args["conv_pool"].clone()
    for step in range(2):
        g = torch.Generator().manual_seed(10 + step)
        normed = torch.randn(batch, D_MODEL, generator=g).to(dtype)
        stream = torch.randn(batch, D_MODEL, generator=g).to(stream_dtype)
        out = mamba_decode_stack_triton(normed, stream, args["norm_weights"], args["eps"], args["layers"],
                                        args["conv_pool"], args["ssm_pool"], args["slot_ids"])
        expected = reference_stack(normed, stream, ref["norm_weights"], ref["eps"], ref["layers"], ref["conv_pool"],
                                   ref["ssm_pool"], ref["slot_ids"])
        assert out.dtype == expected.dtype == dtype
        assert_near(out, expected, dtype)
    assert_near(args["conv_pool"], ref["conv_pool"], dtype)
    assert_near(args["ssm_pool"], ref["ssm_pool"], dtype)
    untouched = torch.ones(args["conv_pool"].shape[0], dtype=torch.bool)
    untouched[args["slot_ids"]] = False
    assert torch.equal(args["conv_pool"][untouched], conv_before[untouched])  # other slots keep their states


@pytest.mark.parametrize("batch", [2, 3])
@torch.inference_mode()
def test_model_decode_runs_the_stack_for_small_batches(triton_on_cpu, monkeypatch, batch) -> None:
    """With Triton, a decode batch of at most STACK_MAX_BATCH runs the stack (logits and states == the op-by-op
    Triton step); a larger one, or ``STACK_ENABLED`` cleared, the op-by-op step."""
    config = MambaConfig(vocab_size=64, d_model=D_MODEL, n_layers=2, d_inner=D_INNER, dt_rank=DT_RANK, use_bias=True)
    model = MambaLM(config).eval()
    model.init_weights(torch.Generator().manual_seed(0))
    calls = count_calls(monkeypatch, [("rnnserve.kernels.mamba_decode.fused_recurrent", "mamba_decode_stack_triton"),
                                      ("rnnserve.kernels.selective_scan.fused_recurrent",
                                       "selective_state_update_triton")])  # fmt: skip
    pools = twin_pools(model, batch + 3)
    slots = (torch.randperm(batch + 2, generator=torch.Generator().manual_seed(2))[:batch] + 1).tolist()
    decode = DecodeBatch.build(list(range(batch)), slots, [4] * batch)
    small = batch <= mamba_decode_ops.STACK_MAX_BATCH
    assert mamba_decode_triton_applies(torch.zeros(batch, D_MODEL), pools[0].tensors["conv"][:, 0],
                                       pools[0].tensors["ssm"][:, 0]) == small  # fmt: skip
    stacked = model.decode(decode, pools[0].tensors)
    monkeypatch.setattr(mamba_decode_ops, "STACK_ENABLED", False)
    looped = model.decode(decode, pools[1].tensors)
    assert calls == {"mamba_decode_stack_triton": int(small), "selective_state_update_triton": 2 * (2 - small)}
    torch.testing.assert_close(stacked, looped, rtol=1e-4, atol=1e-4)
    for name in pools[0].tensors:
        torch.testing.assert_close(pools[0].tensors[name], pools[1].tensors[name], rtol=1e-4, atol=1e-4)


def test_int8_projections_are_refused() -> None:
    from rnnserve.kernels.mamba_decode.fused_recurrent import mamba_decode_stack_triton

    args = stack_args(torch.float32, 1, False, torch.float32)
    args["layers"][1] = (*args["layers"][1][:11], torch.ones(2 * D_INNER), None, None)
    with pytest.raises(ValueError, match="float projections"):
        mamba_decode_stack_triton(args["normed"], args["stream"], args["norm_weights"], args["eps"], args["layers"],
                                  args["conv_pool"], args["ssm_pool"], args["slot_ids"])
