"""The persistent Mamba-2 decode stack on CUDA (one launch a step, a program per SM at most, grid barriers between
phases): == the three-kernel stack and the op-by-op step at mamba2-370m's layer sizes, eagerly and replayed from
a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from rnnserve.engine.models.base import DecodeBatch
from rnnserve.engine.models.mamba2 import Mamba2Config, Mamba2LM
from rnnserve.kernels import mamba2_decode as mamba2_decode_ops
from rnnserve.kernels.mamba2_decode import fused_recurrent
from tests.kernels.kernel_cases import count_calls, twin_pools

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PERSISTENT = ("rnnserve.kernels.mamba2_decode.persistent", "mamba2_decode_stack_persistent")


def model_and_pools(dtype: torch.dtype) -> tuple[Mamba2LM, list]:
    """Four layers of mamba2-370m (32 heads x 64, d_state 128) and two pools of the same states."""
    model = Mamba2LM(Mamba2Config(vocab_size=512, d_model=1024, n_layers=4, n_heads=32, head_dim=64))
    model.init_weights(torch.Generator().manual_seed(0))
    model = model.to("cuda", dtype).eval()
    return model, twin_pools(model, 16, "cuda")


def decode(model: Mamba2LM, batch: DecodeBatch, pool, persistent: bool, monkeypatch) -> torch.Tensor:
    monkeypatch.setattr(fused_recurrent, "PERSISTENT", persistent)
    return model.decode(batch, pool.tensors)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch", [1, 4])
@torch.inference_mode()
def test_persistent_equals_three_kernels_and_op_by_op(monkeypatch, dtype, batch) -> None:
    """Three steps: the persistent stack's logits and states equal the three-kernel stack's (the same items, but
    the SSM items at the persistent launch's 4 warps instead of 8, so sums over a head's states may round
    differently: to 1e-4 in fp32, and one bf16 rounding step apart in bf16), and the op-by-op step's within the
    stack tests' tolerances."""
    monkeypatch.setattr(mamba2_decode_ops, "STACK_MAX_BATCH", 8)
    model, pools = model_and_pools(dtype)
    op_pool = twin_pools(model, 16, "cuda")[0]  # the same states again, for the op-by-op step
    calls = count_calls(monkeypatch, [PERSISTENT])
    slots = (torch.randperm(15)[:batch] + 1).tolist()
    for step in range(3):
        ids = torch.randint(0, 512, (batch,)).tolist()
        rows = DecodeBatch.build(ids, slots, [step] * batch, "cuda")
        ours = decode(model, rows, pools[0], True, monkeypatch)
        theirs = decode(model, rows, pools[1], False, monkeypatch)
        monkeypatch.setattr(mamba2_decode_ops, "STACK_ENABLED", False)
        looped = model.decode(rows, op_pool.tensors)
        monkeypatch.setattr(mamba2_decode_ops, "STACK_ENABLED", True)
        same = {"rtol": 1e-4, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
        torch.testing.assert_close(ours, theirs, **same)
        tol = {"rtol": 1e-3, "atol": 1e-3} if dtype == torch.float32 else {"rtol": 5e-2, "atol": 5e-2}
        torch.testing.assert_close(ours, looped, **tol)
    assert calls[PERSISTENT[1]] == 3
    for name in pools[0].tensors:
        error = (pools[0].tensors[name] - pools[1].tensors[name]).norm() / pools[1].tensors[name].norm()
        assert error < (1e-5 if dtype == torch.float32 else 1e-2), (name, error)
        error = (pools[0].tensors[name] - op_pool.tensors[name]).norm() / op_pool.tensors[name].norm()
        assert error < (1e-4 if dtype == torch.float32 else 1e-2), (name, error)


@pytest.mark.parametrize("batch", [1, 4])
@torch.inference_mode()
def test_persistent_in_a_graph_equals_eager(monkeypatch, batch) -> None:
    """Captured in a CUDA graph after one eager step (which builds the pointer table) and replayed three times:
    logits and states equal three eager steps of the three-kernel stack (fp32, to 1e-4: see above); the counter is
    zeroed inside the graph, so every replay passes its barriers afresh."""
    monkeypatch.setattr(mamba2_decode_ops, "STACK_MAX_BATCH", 8)
    model, pools = model_and_pools(torch.float32)
    slots = (torch.randperm(15)[:batch] + 1).tolist()
    step = DecodeBatch.build(torch.randint(0, 512, (batch,)).tolist(), slots, [4] * batch, "cuda")
    eager = [decode(model, step, pools[1], False, monkeypatch).clone() for _ in range(3)]
    scratch = {name: t.clone() for name, t in pools[0].tensors.items()}
    monkeypatch.setattr(fused_recurrent, "PERSISTENT", True)
    model.decode(step, scratch)  # compiles the kernel and builds the table outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        logits = model.decode(step, pools[0].tensors)
    replayed = []
    for _ in range(3):
        graph.replay()
        replayed.append(logits.clone())
    for ours, theirs in zip(replayed, eager, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    for name in pools[0].tensors:
        torch.testing.assert_close(pools[0].tensors[name], pools[1].tensors[name], rtol=1e-4, atol=1e-4)
