"""Async scheduling on CUDA (its default there): the same tokens as the synchronous engine, and scheduling plus
queuing a step (decode, prefill, sampling) never waits for the device, or the overlap would be lost."""

from __future__ import annotations

import pytest
import torch

from rnnserve.engine import LLM, SamplingParams
from rnnserve.engine.llm_engine import LLMEngine
from tests.gpu.device_waits import never_waits

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PRESETS = ["mingru-tiny", "mamba-tiny", "mamba2-tiny", "hawk-tiny"]
PARAMS = [
    SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2),
    SamplingParams(temperature=0.9, seed=3, n=2, max_tokens=24, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=24, stop_token_ids=list(range(0, 320, 3)), min_tokens=4),
    SamplingParams(temperature=1.0, seed=5, max_tokens=24, repetition_penalty=1.2, presence_penalty=0.5),
]


def no_device_waits(engine: LLMEngine) -> list[str]:
    """Make the engine's scheduling and launching raise on any synchronizing CUDA call; returns where it ran."""
    ran: list[str] = []
    never_waits(engine.scheduler, "schedule", ran)
    never_waits(engine, "_launch", ran)
    return ran


@pytest.mark.parametrize("preset", [f"random:{name}" for name in PRESETS])
def test_async_scheduling_on_cuda_matches_sync_and_never_waits_while_launching(preset: str) -> None:
    prompts = [f"prompt number {i} " * (1 + i % 7) for i in range(23)]
    params = [PARAMS[i % len(PARAMS)] for i in range(len(prompts))]
    options = {"device": "cuda", "dtype": "float32", "max_num_seqs": 20, "max_num_batched_tokens": 64}
    sync = LLM(preset, async_scheduling="off", **options)
    ahead = LLM(preset, **options)
    assert ahead.engine.async_scheduling and not sync.engine.async_scheduling
    ran = no_device_waits(ahead.engine)
    expected, got = sync.generate(prompts, params), ahead.generate(prompts, params)
    assert all(out.error is None for out in got)
    assert [[(s.token_ids, s.finish_reason) for s in o.outputs] for o in got] == [
        [(s.token_ids, s.finish_reason) for s in o.outputs] for o in expected
    ]
    assert ran.count("_launch") > 24  # chunked prompts, queued requests and every decode step went through it
    assert ahead.engine.pool.num_used == 0
