"""The Triton Mamba-1 / Mamba-2 decode stacks on CUDA: == the op-by-op step at the 370m models' layer sizes, and
rows of a batch == each row alone, and through the engine CUDA graphs == eager at the batch sizes that run them."""

from __future__ import annotations

import pytest
import torch

from rnnserve.engine import LLM, SamplingParams
from rnnserve.engine.models.base import DecodeBatch
from rnnserve.engine.models.mamba import MambaConfig, MambaLM
from rnnserve.engine.models.mamba2 import Mamba2Config, Mamba2LM
from rnnserve.kernels import mamba2_decode as mamba2_decode_ops
from rnnserve.kernels import mamba_decode as mamba_decode_ops
from rnnserve.kernels.mamba2_decode import fused_recurrent as mamba2_fused
from rnnserve.kernels.mamba_decode import fused_recurrent as mamba_fused
from rnnserve.kernels.mamba_decode.fused_recurrent import MAX_ROWS
from tests.kernels.kernel_cases import count_calls, twin_pools

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


# Four layers of each 370m model; the stack's wrapper, the module whose STACK_ENABLED switches it.
MODELS = {
    "mamba": (lambda: MambaLM(MambaConfig(vocab_size=512, d_model=1024, n_layers=4, d_inner=2048, dt_rank=64)),
              ("rnnserve.kernels.mamba_decode.fused_recurrent", "mamba_decode_stack_triton"), mamba_decode_ops),
    "mamba2": (lambda: Mamba2LM(Mamba2Config(vocab_size=512, d_model=1024, n_layers=4, n_heads=32, head_dim=64)),
               ("rnnserve.kernels.mamba2_decode.fused_recurrent", "mamba2_decode_stack_triton"), mamba2_decode_ops),
}
LAUNCHES = {"mamba": mamba_fused, "mamba2": mamba2_fused}  # the module holding each stack's LAUNCH_PDL


@pytest.mark.parametrize("architecture", sorted(MODELS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch", [1, 5, MAX_ROWS])
@torch.inference_mode()
def test_stack_equals_op_by_op_step(monkeypatch, architecture, dtype, batch) -> None:
    build, wrapper, switch = MODELS[architecture]
    monkeypatch.setattr(switch, "STACK_MAX_BATCH", MAX_ROWS)  # every batch the kernels take, not only the ones used
    model = build()
    model.init_weights(torch.Generator().manual_seed(0))
    model = model.to("cuda", dtype).eval()
    calls = count_calls(monkeypatch, [wrapper])
    pools = twin_pools(model, 16, "cuda")
    slots = (torch.randperm(15)[:batch] + 1).tolist()
    for step in range(3):
        decode = DecodeBatch.build(torch.randint(0, 512, (batch,)).tolist(), slots, [step] * batch, "cuda")
        monkeypatch.setattr(switch, "STACK_ENABLED", True)
        stacked = model.decode(decode, pools[0].tensors)
        monkeypatch.setattr(switch, "STACK_ENABLED", False)
        looped = model.decode(decode, pools[1].tensors)
        tol = {"rtol": 1e-3, "atol": 1e-3} if dtype == torch.float32 else {"rtol": 5e-2, "atol": 5e-2}
        torch.testing.assert_close(stacked, looped, **tol)
    assert calls[wrapper[1]] == 3
    for name in pools[0].tensors:
        error = (pools[0].tensors[name] - pools[1].tensors[name]).norm() / pools[1].tensors[name].norm()
        assert error < (1e-4 if dtype == torch.float32 else 1e-2), (name, error)


@pytest.mark.parametrize("architecture", sorted(MODELS))
@pytest.mark.parametrize("batch", [1, MAX_ROWS])
@torch.inference_mode()
def test_programmatic_dependent_launch_in_a_graph_changes_no_result(monkeypatch, architecture, batch) -> None:
    """``LAUNCH_PDL``: each stack kernel may start while the one before it runs (prefetching, then waiting for
    it). Captured in a CUDA graph and replayed, three steps equal three plain launches of the stack, logits and
    states (fp32; the same arithmetic, so equal to rounding)."""
    build, wrapper, switch = MODELS[architecture]
    monkeypatch.setattr(switch, "STACK_MAX_BATCH", MAX_ROWS)
    monkeypatch.setattr(switch, "STACK_ENABLED", True)
    model = build()
    model.init_weights(torch.Generator().manual_seed(0))
    model = model.to("cuda").eval()
    pools = twin_pools(model, 16, "cuda")
    slots = (torch.randperm(15)[:batch] + 1).tolist()
    decode = DecodeBatch.build(torch.randint(0, 512, (batch,)).tolist(), slots, [4] * batch, "cuda")
    monkeypatch.setattr(LAUNCHES[architecture], "LAUNCH_PDL", False)
    plain = [model.decode(decode, pools[1].tensors).clone() for _ in range(3)]
    monkeypatch.setattr(LAUNCHES[architecture], "LAUNCH_PDL", True)
    calls = count_calls(monkeypatch, [wrapper])
    scratch = {name: t.clone() for name, t in pools[0].tensors.items()}
    model.decode(decode, scratch)  # builds the PDL kernels outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        logits = model.decode(decode, pools[0].tensors)
    replayed = []
    for _ in range(3):
        graph.replay()
        replayed.append(logits.clone())
    assert calls[wrapper[1]] == 2
    for ours, theirs in zip(replayed, plain, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    for name in pools[0].tensors:
        torch.testing.assert_close(pools[0].tensors[name], pools[1].tensors[name], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("architecture", sorted(MODELS))
@torch.inference_mode()
def test_each_row_of_a_batch_equals_the_row_alone(monkeypatch, architecture) -> None:
    """A row's logits and states do not depend on the rows beside it (fp32; a batch of 5 runs 8-row tiles, one
    row alone 1-row tiles, so the sums' order differs: equal to 1e-5, not bit for bit)."""
    monkeypatch.setattr(MODELS[architecture][2], "STACK_MAX_BATCH", MAX_ROWS)
    model = MODELS[architecture][0]()
    model.init_weights(torch.Generator().manual_seed(0))
    model = model.to("cuda").eval()
    pools = twin_pools(model, 16, "cuda")
    slots, ids = [9, 2, 14, 5, 7], [3, 70, 500, 1, 42]
    batched = model.decode(DecodeBatch.build(ids, slots, [4] * 5, "cuda"), pools[0].tensors)
    for row, (token, slot) in enumerate(zip(ids, slots, strict=True)):
        alone = model.decode(DecodeBatch.build([token], [slot], [4], "cuda"), pools[1].tensors)
        torch.testing.assert_close(alone[0], batched[row], rtol=1e-5, atol=1e-5)
    for name in pools[0].tensors:
        torch.testing.assert_close(pools[1].tensors[name], pools[0].tensors[name], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("preset", ["random:mamba-tiny", "random:mamba2-tiny"])
def test_engine_graphs_equal_eager_at_small_batches(preset: str) -> None:
    """Decode batches of 1 to 6 rows: eager runs each at its power-of-two tile, the graph of the same bucket too,
    so the tokens are equal bit for bit."""
    prompts = [f"prompt number {i} " * (1 + i % 3) for i in range(MAX_ROWS - 2)]
    params = SamplingParams(temperature=0, max_tokens=32)
    graphs = LLM(preset, device="cuda", dtype="float32", max_num_seqs=8).generate(prompts, params)
    eager = LLM(preset, device="cuda", dtype="float32", max_num_seqs=8, enforce_eager=True).generate(prompts, params)
    assert [o.outputs[0].token_ids for o in graphs] == [o.outputs[0].token_ids for o in eager]
