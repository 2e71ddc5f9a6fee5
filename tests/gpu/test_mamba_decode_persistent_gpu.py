"""The persistent Mamba-1 decode stack on CUDA (one launch a step, its programs meeting at grid barriers): == the
three-kernel stack and the op-by-op step at mamba-370m's layer sizes, eager and replayed from a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from rnnserve.engine.models.base import DecodeBatch
from rnnserve.engine.models.mamba import MambaConfig, MambaLM
from rnnserve.kernels import mamba_decode as mamba_decode_ops
from rnnserve.kernels.mamba_decode import fused_recurrent
from rnnserve.kernels.mamba_decode.fused_recurrent import MAX_ROWS
from rnnserve.kernels.mamba_decode.persistent import persistent_grid
from tests.kernels.kernel_cases import count_calls, twin_pools

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PERSISTENT = ("rnnserve.kernels.mamba_decode.persistent", "mamba_decode_stack_persistent")


def model_370m_layers(dtype: torch.dtype) -> MambaLM:
    """Four layers of mamba-370m (d_model 1024, d_inner 2048, dt_rank 64), random weights."""
    model = MambaLM(MambaConfig(vocab_size=512, d_model=1024, n_layers=4, d_inner=2048, dt_rank=64))
    model.init_weights(torch.Generator().manual_seed(0))
    return model.to("cuda", dtype).eval()


def decode_with(monkeypatch: pytest.MonkeyPatch, model: MambaLM, decode: DecodeBatch, pools: dict, how: str):
    """One decode step: ``persistent``, ``three`` kernels a layer, or ``op-by-op``."""
    monkeypatch.setattr(mamba_decode_ops, "STACK_ENABLED", how != "op-by-op")
    monkeypatch.setattr(fused_recurrent, "PERSISTENT", how == "persistent")
    return model.decode(decode, pools)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch", [1, 5, MAX_ROWS])
@torch.inference_mode()
def test_persistent_stack_equals_three_kernels_and_op_by_op(monkeypatch, dtype, batch) -> None:
    """Three steps; the persistent kernel's 8 warps may sum the SSM's and the final norm's terms in another order
    than the 4-warp launches, so equal to rounding, not bit for bit."""
    monkeypatch.setattr(mamba_decode_ops, "STACK_MAX_BATCH", MAX_ROWS)
    model = model_370m_layers(dtype)
    calls = count_calls(monkeypatch, [PERSISTENT])
    pools = [*twin_pools(model, 16, "cuda"), twin_pools(model, 16, "cuda")[0]]  # seeded: the same states
    slots = (torch.randperm(15)[:batch] + 1).tolist()
    assert persistent_grid(torch.device("cuda"), 256) == min(256, torch.cuda.get_device_properties(0)
                                                                 .multi_processor_count)
    for step in range(3):
        decode = DecodeBatch.build(torch.randint(0, 512, (batch,)).tolist(), slots, [step] * batch, "cuda")
        one, three, looped = (decode_with(monkeypatch, model, decode, pool.tensors, how)
                              for pool, how in zip(pools, ("persistent", "three", "op-by-op"), strict=True))
        if dtype == torch.float32:
            torch.testing.assert_close(one, three, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(one, looped, rtol=1e-3, atol=1e-3)
        else:
            assert (one - three).norm() / three.norm() < 1e-2
            torch.testing.assert_close(one, looped, rtol=5e-2, atol=5e-2)
    assert calls[PERSISTENT[1]] == 3
    for name in pools[0].tensors:
        for other in pools[1:]:
            error = (pools[0].tensors[name] - other.tensors[name]).norm() / other.tensors[name].norm()
            assert error < (1e-4 if dtype == torch.float32 else 1e-2), (name, error)


@pytest.mark.parametrize("batch", [1, MAX_ROWS])
@torch.inference_mode()
def test_persistent_stack_replayed_from_a_graph_equals_three_kernels(monkeypatch, batch) -> None:
    """Captured in a CUDA graph (the counter's memset, the launch; the pointer table built by the eager step
    before) and replayed three times: == three eager steps of the three-kernel stack, logits and states (fp32)."""
    monkeypatch.setattr(mamba_decode_ops, "STACK_MAX_BATCH", MAX_ROWS)
    model = model_370m_layers(torch.float32)
    pools = twin_pools(model, 16, "cuda")
    slots = (torch.randperm(15)[:batch] + 1).tolist()
    decode = DecodeBatch.build(torch.randint(0, 512, (batch,)).tolist(), slots, [4] * batch, "cuda")
    three = [decode_with(monkeypatch, model, decode, pools[1].tensors, "three").clone() for _ in range(3)]
    calls = count_calls(monkeypatch, [PERSISTENT])
    scratch = {name: t.clone() for name, t in pools[0].tensors.items()}
    decode_with(monkeypatch, model, decode, scratch, "persistent")  # compiles, builds the table
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        logits = decode_with(monkeypatch, model, decode, pools[0].tensors, "persistent")
    replayed = []
    for _ in range(3):
        graph.replay()
        replayed.append(logits.clone())
    torch.cuda.synchronize()
    assert calls[PERSISTENT[1]] == 2
    for ours, theirs in zip(replayed, three, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    for name in pools[0].tensors:
        torch.testing.assert_close(pools[0].tensors[name], pools[1].tensors[name], rtol=1e-5, atol=1e-5)
