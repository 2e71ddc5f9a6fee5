"""The one-op Mamba decode step (every layer in C++) == the per-layer loop, bit for bit, logits and states; with
``--quantize int8`` or ``int4`` weights the loop is the quantized model's op-by-op step."""

from __future__ import annotations

import pytest
import torch

from rnnserve.engine.models.base import DecodeBatch
from rnnserve.engine.models.mamba import MambaConfig, MambaLM
from rnnserve.engine.quantize import Int4Linear, Int8Linear, quantize_model
from rnnserve.engine.state_pool import StatePool
from rnnserve.kernels import gemv as gemv_module
from rnnserve.kernels import mamba_decode as mamba_decode_ops
from rnnserve.kernels.cpu_extension import cpu_ops
from tests.kernels.kernel_cases import count_calls, twin_pools

pytestmark = pytest.mark.skipif(not cpu_ops(), reason="fused CPU kernels could not be built")


def tiny_mamba(dtype: torch.dtype, use_bias: bool, residual_in_fp32: bool) -> MambaLM:
    config = MambaConfig(
        vocab_size=64, d_model=48, n_layers=3, d_inner=96, d_state=16, dt_rank=3, use_bias=use_bias,
        residual_in_fp32=residual_in_fp32,
    )  # fmt: skip
    model = MambaLM(config)
    model.init_weights(torch.Generator().manual_seed(0))
    with torch.no_grad():
        for block in model.backbone.layers:
            block.norm.weight.normal_(1, 0.1)
            if use_bias:  # init_weights leaves linear biases at zero
                block.mixer.in_proj.bias.normal_(0, 0.1)
                block.mixer.out_proj.bias.normal_(0, 0.1)
        model.backbone.norm_f.weight.normal_(1, 0.1)
    return model.to(dtype).eval()


@pytest.mark.parametrize(("dtype", "upcast_bf16"), [(torch.float32, False), (torch.bfloat16, False),
                                                    (torch.bfloat16, True)])  # fmt: skip
@pytest.mark.parametrize("batch", [1, 3, 40, 70])
@pytest.mark.parametrize(("use_bias", "residual_in_fp32"), [(False, True), (True, False)])
@pytest.mark.parametrize("quantized", [None, "int8", "int4"])
def test_stack_equals_layer_loop(
    dtype: torch.dtype,
    batch: int,
    use_bias: bool,
    residual_in_fp32: bool,
    quantized: str | None,
    upcast_bf16: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Slots out of order; 40 rows take the quantized kernels' GEMM path and transposed outputs, 70 rows the GEMMs
    past the GEMV kernel (bf16 in fp32 where ``upcast_bf16``, as on CPUs without bf16 arithmetic)."""
    monkeypatch.setattr(gemv_module, "UPCAST_BF16_GEMM", upcast_bf16)
    model = tiny_mamba(dtype, use_bias, residual_in_fp32)
    if quantized:
        quantize_model(model, quantized)
        mixer = model.backbone.layers[0].mixer
        kind = Int8Linear if quantized == "int8" else Int4Linear
        assert all(isinstance(layer, kind) for layer in (mixer.in_proj, mixer.x_proj, mixer.out_proj))
    pools = twin_pools(model, batch + 5)
    slots = (torch.randperm(batch + 4, generator=torch.Generator().manual_seed(2))[:batch] + 1).tolist()
    module = "rnnserve.engine.models.mamba"
    calls = count_calls(monkeypatch, [(module, "mamba_decode_stack"), (module, "mamba_mixer_decode")])
    g = torch.Generator().manual_seed(3)
    with torch.inference_mode():
        for step in range(3):
            ids = torch.randint(0, 64, (batch,), generator=g).tolist()
            decode = DecodeBatch.build(ids, slots, [step] * batch)
            monkeypatch.setattr(mamba_decode_ops, "STACK_ENABLED", True)
            stacked = model.decode(decode, pools[0].tensors)
            monkeypatch.setattr(mamba_decode_ops, "STACK_ENABLED", False)
            looped = model.decode(decode, pools[1].tensors)
            assert stacked.dtype == looped.dtype == torch.float32
            assert torch.equal(stacked, looped)
    assert calls["mamba_decode_stack"] == 3
    assert calls["mamba_mixer_decode"] == (0 if quantized else 3 * 3)  # quantized: the loop runs op by op
    for name in pools[0].tensors:
        assert torch.equal(pools[0].tensors[name], pools[1].tensors[name])


def test_falcon_mamba_keeps_the_layer_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """FalconMamba's extra norms are not in the fused op: its decode never reaches the stack."""
    config = MambaConfig(vocab_size=64, d_model=48, n_layers=2, d_inner=96, dt_rank=3, bcdt_rms_norm=True)
    model = MambaLM(config)
    model.init_weights(torch.Generator().manual_seed(0))
    calls = count_calls(monkeypatch, [("rnnserve.engine.models.mamba", "mamba_decode_stack")])
    pool = StatePool(model.state_spec(), 2)
    with torch.inference_mode():
        logits = model.decode(DecodeBatch.build([5], [1], [0]), pool.tensors)
    assert logits.shape == (1, 64) and calls["mamba_decode_stack"] == 0
