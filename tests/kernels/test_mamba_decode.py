"""The fused Mamba-1 mixer decode op computes exactly what the op-by-op Python step computes."""

from __future__ import annotations

import pytest
import torch

from rnnserve.engine.models.mamba import MambaConfig, MambaLM
from rnnserve.engine.state_pool import StatePool
from rnnserve.kernels.cpu_extension import cpu_ops
from rnnserve.kernels.mamba_decode import fused_mixer_decode_applies

pytestmark = pytest.mark.skipif(not cpu_ops(), reason="fused CPU kernels could not be built")


def tiny_mamba(dtype: torch.dtype, use_bias: bool) -> MambaLM:
    config = MambaConfig(vocab_size=64, d_model=48, n_layers=2, d_inner=96, d_state=16, dt_rank=3, use_bias=use_bias)
    model = MambaLM(config)
    model.init_weights(torch.Generator().manual_seed(0))
    if use_bias:  # init_weights leaves linear biases at zero
        with torch.no_grad():
            for layer in model.backbone.layers:
                layer.mixer.in_proj.bias.normal_(0, 0.1)
                layer.mixer.out_proj.bias.normal_(0, 0.1)
    return model.to(dtype).eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch", [1, 3, 40])  # 40 rows: past the AMX kernel's 32, the W @ x^T GEMMs
@pytest.mark.parametrize("use_bias", [False, True])
def test_fused_step_equals_unfused_step(dtype: torch.dtype, batch: int, use_bias: bool) -> None:
    model = tiny_mamba(dtype, use_bias)
    mixer = model.backbone.layers[0].mixer
    pools = [StatePool(model.state_spec(), batch + 5) for _ in range(2)]
    for pool in pools:  # the same non-zero states in both
        for tensor in pool.tensors.values():
            tensor.copy_(torch.randn(tensor.shape, generator=torch.Generator().manual_seed(1)))
    slot_ids = torch.randperm(batch + 4, generator=torch.Generator().manual_seed(2))[:batch] + 1
    g = torch.Generator().manual_seed(3)
    with torch.inference_mode():
        for _ in range(3):
            h = torch.randn(batch, 48, generator=g).to(dtype)
            conv = [pool.tensors["conv"][:, 0] for pool in pools]
            ssm = [pool.tensors["ssm"][:, 0] for pool in pools]
            assert fused_mixer_decode_applies(h, conv[0], ssm[0])
            fused = mixer.decode(h, slot_ids, slot_ids, conv[0], ssm[0])
            unfused = mixer.decode_unfused(h, slot_ids, slot_ids, conv[1], ssm[1])
            assert fused.dtype == unfused.dtype == dtype
            assert torch.equal(fused, unfused)
    for name in pools[0].tensors:
        assert torch.equal(pools[0].tensors[name], pools[1].tensors[name])


@torch.inference_mode()
def test_other_inputs_take_the_unfused_path() -> None:
    pool = StatePool(tiny_mamba(torch.float32, False).state_spec(), 2)
    conv, ssm = pool.tensors["conv"][:, 0], pool.tensors["ssm"][:, 0]
    assert not fused_mixer_decode_applies(torch.zeros(2, 48, dtype=torch.float16), conv, ssm)
    assert not fused_mixer_decode_applies(torch.zeros(2, 48), conv.double(), ssm)
    assert not fused_mixer_decode_applies(torch.zeros(2, 48), conv, ssm.transpose(-1, -2))
    with torch.enable_grad():
        assert not fused_mixer_decode_applies(torch.zeros(2, 48), conv, ssm)
