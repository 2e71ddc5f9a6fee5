"""Mamba-1, Mamba-2 and Griffin with every Triton kernel forced (interpreter) == the PyTorch/C++ path."""

from __future__ import annotations

import pytest
import torch

from rnnserve.engine.models.base import DecodeBatch, PrefillBatch, RecurrentLM
from rnnserve.engine.models.mamba import MambaConfig, MambaLM
from rnnserve.engine.models.mamba2 import Mamba2Config, Mamba2LM
from rnnserve.engine.models.recurrent_gemma import RecurrentGemmaConfig, RecurrentGemmaLM
from rnnserve.engine.state_pool import StatePool
from rnnserve.kernels import mamba2_decode, mamba_decode
from rnnserve.kernels.backend import force_triton
from rnnserve.kernels.mamba_decode.fused_recurrent import MAX_ROWS
from tests.kernels.kernel_cases import count_calls

VOCAB = 64
MODELS = {
    "mamba": lambda: MambaLM(MambaConfig(vocab_size=VOCAB, d_model=16, n_layers=2, d_inner=32, dt_rank=2)),
    "mamba2": lambda: Mamba2LM(
        Mamba2Config(vocab_size=VOCAB, d_model=16, n_layers=2, n_heads=2, head_dim=16, d_state=16)
    ),
    # A 6-token window: prompts and decode steps run past it, so the ring wraps in both kernels.
    "griffin": lambda: RecurrentGemmaLM(
        RecurrentGemmaConfig(vocab_size=VOCAB, hidden_size=16, n_layers=3, mlp_width=32, n_heads=2, n_kv_heads=1,
                             head_dim=16, lru_width=16, rotary_dim=8, window=6)
    ),
}
WRAPPERS = {
    "mamba": [
        ("rnnserve.kernels.selective_scan.chunk", "selective_scan_varlen_triton"),
        ("rnnserve.kernels.mamba_decode.fused_recurrent", "mamba_decode_stack_triton"),
    ],
    "mamba2": [
        ("rnnserve.kernels.ssd.chunk", "ssd_scan_varlen_triton"),
        ("rnnserve.kernels.mamba2_decode.fused_recurrent", "mamba2_decode_stack_triton"),
    ],
    "griffin": [
        ("rnnserve.kernels.sliding_window.chunk", "sliding_window_prefill_triton"),
        ("rnnserve.kernels.sliding_window.fused_recurrent", "sliding_window_decode_triton"),
        ("rnnserve.kernels.diag_linear_scan.chunk", "diag_scan_varlen_triton"),
        ("rnnserve.kernels.rg_lru.fused_recurrent", "rg_lru_step_triton"),
    ],
}


@pytest.mark.parametrize("architecture", sorted(MODELS))
def test_logits_and_states_match_reference(triton_on_cpu, monkeypatch, architecture):
    calls = count_calls(monkeypatch, WRAPPERS[architecture])
    for stack in (mamba_decode, mamba2_decode):  # the decode stacks at this 3-row batch too
        monkeypatch.setattr(stack, "STACK_MAX_BATCH", MAX_ROWS)
    model: RecurrentLM = MODELS[architecture]().eval()
    model.init_weights(torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(1)
    pools = {backend: StatePool(model.state_spec(), num_slots=6) for backend in ("reference", "triton")}
    slots, consumed = [4, 0, 2], [0, 0, 0]
    prefills = []
    for lengths in ([1, 21, 5], [17, 1, 3]):  # the second chunk continues from non-zero states
        chunks = [torch.randint(0, VOCAB, (n,), generator=gen) for n in lengths]
        prefills.append(PrefillBatch.build(chunks, slots, consumed))
        consumed = [c + n for c, n in zip(consumed, lengths, strict=True)]
    steps = []
    for _ in range(2):
        steps.append(DecodeBatch.build(torch.randint(0, VOCAB, (3,), generator=gen).tolist(), slots, consumed))
        consumed = [c + 1 for c in consumed]
    logits = {}
    with torch.inference_mode():
        for backend, pool in pools.items():
            with force_triton(backend == "triton"):
                outs = [model.prefill(batch, pool.tensors) for batch in prefills]
                outs += [model.decode(batch, pool.tensors) for batch in steps]
            logits[backend] = torch.stack(outs)
    assert all(count > 0 for count in calls.values()), calls
    torch.testing.assert_close(logits["triton"], logits["reference"], rtol=1e-4, atol=1e-4)
    for name, expected in pools["reference"].tensors.items():
        torch.testing.assert_close(pools["triton"].tensors[name], expected, rtol=1e-4, atol=1e-4)
