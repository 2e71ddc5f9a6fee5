"""CUDA-graph decode == eager decode for every bucket; padding rows stay in the scratch slot."""

from __future__ import annotations

import pytest
import torch

from rnnserve.engine.cuda_graph_runner import CUDAGraphDecodeRunner, bucket_sizes
from rnnserve.engine.models.base import DecodeBatch
from rnnserve.engine.models.minrnn import MinGRULM, MinRNNConfig
from rnnserve.engine.state_pool import StatePool

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
MAX_NUM_SEQS = 40
NUM_STEPS = 64


def test_bucket_sizes():
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    assert bucket_sizes(256) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert bucket_sizes(1000) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 768, 1000]
    with pytest.raises(ValueError):
        bucket_sizes(0)


def test_runner_refuses_a_cpu_state_pool():
    pool = StatePool(MinGRULM(MinRNNConfig(d_model=8, n_layers=1)).state_spec(), num_slots=2)
    with pytest.raises(ValueError, match="CUDA"):
        CUDAGraphDecodeRunner(torch.nn.Identity(), pool.tensors, pool.scratch_slot, 2)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def setup() -> tuple[MinGRULM, StatePool, StatePool, CUDAGraphDecodeRunner]:
    """A model, an eager pool and a graph pool with its runner, captured once for all buckets."""
    model = MinGRULM(MinRNNConfig(vocab_size=320, d_model=256, n_layers=3))
    model.init_weights(torch.Generator().manual_seed(0))
    model = model.cuda().eval()
    eager, graph = (StatePool(model.state_spec(), num_slots=MAX_NUM_SEQS + 8, device="cuda") for _ in range(2))
    runner = CUDAGraphDecodeRunner(model, graph.tensors, graph.scratch_slot, MAX_NUM_SEQS)
    runner.capture()
    return model, eager, graph, runner


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("batch", [1, 2, 3, 4, 7, 8, 9, 16, 31, 32, 33, 40])
def test_graph_decode_matches_eager(setup, batch):
    model, eager, graph, runner = setup
    assert runner.bucket_for(batch) in runner.buckets
    # Identical random states in both pools (in place: the graphs hold the addresses); poisoned scratch slot.
    gen = torch.Generator(device="cuda").manual_seed(batch)
    for name, tensor in eager.tensors.items():
        tensor.copy_(torch.rand(tensor.shape, device="cuda", generator=gen))
        graph.tensors[name].copy_(tensor)
        graph.tensors[name][graph.scratch_slot] = float("nan")
    cpu_gen = torch.Generator().manual_seed(batch)
    # Slots out of order with gaps; the untouched slots must keep their states.
    slots = torch.randperm(MAX_NUM_SEQS + 8, generator=cpu_gen)[:batch].tolist()
    with torch.inference_mode():
        for step in range(NUM_STEPS):
            ids = torch.randint(0, 320, (batch,), generator=cpu_gen).tolist()
            decode = DecodeBatch.build(ids, slots, [step] * batch, device="cuda")
            expected = model.decode(decode, eager.tensors)
            got = runner(decode)
            assert got.shape == expected.shape
            assert torch.isfinite(got).all(), "the scratch slot leaked into a real row"
            torch.testing.assert_close(got, expected, rtol=1e-3, atol=1e-3)
    real = slice(0, graph.scratch_slot)
    for name in eager.tensors:
        assert torch.isfinite(graph.tensors[name][real]).all(), "the scratch slot leaked into a real slot"
        torch.testing.assert_close(graph.tensors[name][real], eager.tensors[name][real], rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@requires_cuda
def test_oversized_batch_is_rejected(setup):
    runner = setup[3]
    zeros = [0] * (MAX_NUM_SEQS + 1)
    with pytest.raises(ValueError, match="outside"):
        runner(DecodeBatch.build(zeros, zeros, zeros, device="cuda"))
