"""The fused Mamba-1 mixer decode op == its reference, and == the model's op-by-op step bit for bit."""

from __future__ import annotations

import pytest
import torch

from rnnserve.engine.models.mamba import MambaConfig, MambaLM
from rnnserve.kernels import gemv
from rnnserve.kernels.cpu_extension import cpu_ops
from rnnserve.kernels.mamba_decode import mamba_mixer_decode, mamba_mixer_decode_applies
from rnnserve.kernels.mamba_decode.naive import mamba_mixer_decode_ref
from tests.kernels.kernel_cases import twin_pools

pytestmark = pytest.mark.skipif(not cpu_ops(), reason="fused CPU kernels could not be built")

D_MODEL, D_INNER, D_STATE, DT_RANK, WIDTH, LAYERS = 48, 96, 16, 3, 4, 2


def mixer_args(dtype: torch.dtype, batch: int, use_bias: bool, seed: int = 0) -> dict[str, torch.Tensor | None]:
    """Random weights (projections in ``dtype``, the rest fp32), layer views of two-layer pools with non-zero
    states, and slot ids out of order with gaps."""
    g = torch.Generator().manual_seed(seed)

    def weight(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) / shape[-1] ** 0.5).to(dtype)

    def bias(n: int) -> torch.Tensor | None:
        return (torch.randn(n, generator=g) * 0.1).to(dtype) if use_bias else None

    slots = batch + 5
    return {
        "h": torch.randn(batch, D_MODEL, generator=g).to(dtype),
        "in_proj_weight": weight(2 * D_INNER, D_MODEL),
        "in_proj_bias": bias(2 * D_INNER),
        "conv_pool": torch.randn(slots, LAYERS, D_INNER, WIDTH - 1, generator=g)[:, 1],
        "conv_weight": torch.randn(D_INNER, WIDTH, generator=g) / 2,
        "conv_bias": torch.randn(D_INNER, generator=g) * 0.1 if use_bias else None,
        "slot_ids": torch.randperm(slots - 1, generator=g)[:batch] + 1,
        "x_proj_weight": weight(DT_RANK + 2 * D_STATE, D_INNER),
        "dt_proj_weight": weight(D_INNER, DT_RANK),
        "dt_bias": torch.rand(D_INNER, generator=g) - 4,
        "A": -torch.rand(D_INNER, D_STATE, generator=g) * 4,
        "D": torch.randn(D_INNER, generator=g),
        "ssm_pool": torch.randn(slots, LAYERS, D_INNER, D_STATE, generator=g)[:, 1],
        "out_proj_weight": weight(D_MODEL, D_INNER),
        "out_proj_bias": bias(D_MODEL),
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch", [1, 3, 40])  # 40 rows: past the AMX kernel's 32, the W @ x^T GEMMs
@pytest.mark.parametrize("use_bias", [False, True])
@torch.inference_mode()
def test_fused_op_matches_reference(dtype: torch.dtype, batch: int, use_bias: bool) -> None:
    fused_args = mixer_args(dtype, batch, use_bias)
    ref_args = {name: None if t is None else t.clone() for name, t in fused_args.items()}
    conv_before = fused_args["conv_pool"].clone()
    assert mamba_mixer_decode_applies(fused_args["h"], fused_args["conv_pool"], fused_args["ssm_pool"])
    for step in range(3):
        h = torch.randn(batch, D_MODEL, generator=torch.Generator().manual_seed(10 + step)).to(dtype)
        fused_args["h"] = ref_args["h"] = h
        out = mamba_mixer_decode(**fused_args)
        expected = mamba_mixer_decode_ref(**ref_args)
        assert out.dtype == dtype and out.shape == (batch, D_MODEL)
        # bf16: the op and the reference round their GEMMs differently (a bf16 ulp or two per step).
        tol = {"rtol": 1e-4, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 5e-2, "atol": 5e-2}
        torch.testing.assert_close(out, expected, **tol)
        for pool in ("conv_pool", "ssm_pool"):
            torch.testing.assert_close(fused_args[pool], ref_args[pool], **tol)
    untouched = torch.ones(conv_before.shape[0], dtype=torch.bool)
    untouched[fused_args["slot_ids"]] = False
    assert torch.equal(fused_args["conv_pool"][untouched], conv_before[untouched])


def tiny_mamba(dtype: torch.dtype, use_bias: bool) -> MambaLM:
    config = MambaConfig(
        vocab_size=64, d_model=D_MODEL, n_layers=LAYERS, d_inner=D_INNER, d_state=D_STATE, dt_rank=DT_RANK,
        use_bias=use_bias,
    )
    model = MambaLM(config)
    model.init_weights(torch.Generator().manual_seed(0))
    if use_bias:  # init_weights leaves linear biases at zero
        with torch.no_grad():
            for layer in model.backbone.layers:
                layer.mixer.in_proj.bias.normal_(0, 0.1)
                layer.mixer.out_proj.bias.normal_(0, 0.1)
    return model.to(dtype).eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch", [1, 3, 40])
@pytest.mark.parametrize("use_bias", [False, True])
def test_model_fused_step_equals_its_op_by_op_step(dtype: torch.dtype, batch: int, use_bias: bool) -> None:
    """The fused op picks every GEMM path as the model's ``matmul_t`` does: the same numbers, bit for bit."""
    model = tiny_mamba(dtype, use_bias)
    mixer = model.backbone.layers[0].mixer
    pools = twin_pools(model, batch + 5)
    slot_ids = torch.randperm(batch + 4, generator=torch.Generator().manual_seed(2))[:batch] + 1
    g = torch.Generator().manual_seed(3)
    with torch.inference_mode():
        for _ in range(3):
            h = torch.randn(batch, D_MODEL, generator=g).to(dtype)
            conv = [pool.tensors["conv"][:, 0] for pool in pools]
            ssm = [pool.tensors["ssm"][:, 0] for pool in pools]
            assert mamba_mixer_decode_applies(h, conv[0], ssm[0])
            fused = mixer.decode(h, slot_ids, slot_ids, conv[0], ssm[0])
            unfused = mixer.decode_unfused(h, slot_ids, slot_ids, conv[1], ssm[1])
            assert fused.dtype == unfused.dtype == dtype
            assert torch.equal(fused, unfused)
    for name in pools[0].tensors:
        assert torch.equal(pools[0].tensors[name], pools[1].tensors[name])


def test_fused_step_takes_each_projections_own_row_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the fp32 short-K limit between the projections' widths (in_proj K = 48 and dt_proj K = 3 take the
    kernel at 40 rows beside oneDNN, x_proj and out_proj K = 96 do not), the op still routes each as matmul_t."""
    monkeypatch.setattr(gemv, "FP32_SHORT_K", 64)
    monkeypatch.setattr(gemv, "FP32_SHORT_K_ROWS", 64)
    test_model_fused_step_equals_its_op_by_op_step(torch.float32, 40, True)


@torch.inference_mode()
def test_other_inputs_do_not_apply() -> None:
    args = mixer_args(torch.float32, 2, False)
    conv, ssm = args["conv_pool"], args["ssm_pool"]
    assert mamba_mixer_decode_applies(torch.zeros(2, D_MODEL), conv, ssm)
    assert not mamba_mixer_decode_applies(torch.zeros(2, D_MODEL, dtype=torch.float16), conv, ssm)
    assert not mamba_mixer_decode_applies(torch.zeros(2, D_MODEL), conv.double(), ssm)
    assert not mamba_mixer_decode_applies(torch.zeros(2, D_MODEL), conv, ssm.transpose(-1, -2))
    with torch.enable_grad():
        assert not mamba_mixer_decode_applies(torch.zeros(2, D_MODEL), conv, ssm)


@pytest.mark.skipif(not gemv.ONEDNN_FP32_GEMM, reason="needs PyTorch's oneDNN (x86 builds)")
@pytest.mark.parametrize("onednn", [True, False])
def test_fused_op_takes_onednn_as_matmul_t_does(onednn: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """At the tests' small sizes oneDNN and MKL sum in the same order, so equal numbers do not show which GEMM
    ran: the profiler does (the op calls oneDNN through the dispatcher, past the kernel's rows, in fp32)."""
    monkeypatch.setattr(gemv, "ONEDNN_FP32_GEMM", onednn)
    args = mixer_args(torch.float32, 70, use_bias=True)  # past the kernel's 64 rows, whatever the weights' K
    with torch.inference_mode(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        mamba_mixer_decode(**args)
    called = {event.key for event in prof.key_averages()}
    assert ("mkldnn::_linear_pointwise" in called) == onednn
