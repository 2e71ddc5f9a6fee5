"""minGRU / minLSTM with every Triton kernel forced (interpreter) == the reference path."""

from __future__ import annotations

import pytest
import torch

from rnnserve.engine.models.base import DecodeBatch, PrefillBatch
from rnnserve.engine.models.minrnn import MinGRULM, MinLSTMLM, MinRNNConfig
from rnnserve.engine.state_pool import StatePool
from rnnserve.kernels.backend import force_triton
from tests.kernels.kernel_cases import count_calls

pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered in log")

TRITON_WRAPPERS = [
    ("rnnserve.kernels.add_norm.fused", "add_norm_triton"),
    ("rnnserve.kernels.causal_conv1d.chunk", "causal_conv1d_varlen_triton"),
    ("rnnserve.kernels.causal_conv1d.fused_recurrent", "causal_conv1d_update_triton"),
    ("rnnserve.kernels.diag_linear_scan.chunk", "diag_scan_varlen_triton"),
    ("rnnserve.kernels.min_rnn_step.fused_recurrent", "min_rnn_step_triton"),
]


@pytest.fixture
def kernel_calls(monkeypatch) -> dict[str, int]:
    return count_calls(monkeypatch, TRITON_WRAPPERS)


@pytest.mark.parametrize("model_class", [MinGRULM, MinLSTMLM])
def test_logits_and_states_match_reference(triton_on_cpu, kernel_calls, model_class):
    config = MinRNNConfig(vocab_size=50, d_model=16, n_layers=2, scan_chunk_size=8)
    model = model_class(config).eval()
    model.init_weights(torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(1)
    pools = {backend: StatePool(model.state_spec(), num_slots=7) for backend in ("reference", "triton")}
    slots = [5, 0, 3]
    # Two prefill chunks (the second continues from non-zero states), then decode steps.
    consumed = [0, 0, 0]
    prefills = []
    for lengths in ([1, 11, 9], [9, 1, 3]):
        chunks = [torch.randint(0, 50, (n,), generator=gen) for n in lengths]
        prefills.append(PrefillBatch.build(chunks, slots, consumed))
        consumed = [c + n for c, n in zip(consumed, lengths, strict=True)]
    steps = []
    for _ in range(3):
        steps.append(DecodeBatch.build(torch.randint(0, 50, (3,), generator=gen).tolist(), slots, consumed))
        consumed = [c + 1 for c in consumed]
    logits = {}
    with torch.no_grad():
        for backend, pool in pools.items():
            with force_triton(backend == "triton"):
                outs = [model.prefill(batch, pool.tensors) for batch in prefills]
                outs += [model.decode(batch, pool.tensors) for batch in steps]
            logits[backend] = torch.stack(outs)
    assert all(count > 0 for count in kernel_calls.values()), kernel_calls
    torch.testing.assert_close(logits["triton"], logits["reference"], rtol=1e-4, atol=1e-4)
    for name, expected in pools["reference"].tensors.items():
        torch.testing.assert_close(pools["triton"].tensors[name], expected, rtol=1e-5, atol=1e-5)
