"""Through the whole engine on CUDA: CUDA-graph decode gives the same tokens as eager decode."""

from __future__ import annotations

import pytest
import torch

from rnnserve.engine import LLM, SamplingParams
from tests.engine.test_decoded_prompts import count_fed_tokens

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


PRESETS = ["mingru-tiny", "minlstm-tiny", "mamba-tiny", "mamba2-tiny", "hawk-tiny"]


@pytest.mark.parametrize("preset", [f"random:{name}" for name in PRESETS])
def test_engine_with_graphs_matches_eager(preset: str) -> None:
    prompts = [f"prompt number {i} " * (1 + i % 5) for i in range(37)]  # 37 rows: a padded bucket
    params = [SamplingParams(temperature=0, max_tokens=48), SamplingParams(temperature=0.9, seed=3, max_tokens=48)]
    for sp in params:
        graphs = LLM(preset, device="cuda", dtype="float32", max_num_seqs=40).generate(prompts, sp)
        eager = LLM(preset, device="cuda", dtype="float32", max_num_seqs=40, enforce_eager=True).generate(prompts, sp)
        assert [o.outputs[0].token_ids for o in graphs] == [o.outputs[0].token_ids for o in eager]


def test_graph_runner_is_used_on_cuda_only_without_enforce_eager() -> None:
    assert LLM("random:mingru-tiny", device="cuda", max_num_seqs=4).engine.runner.graphs is not None
    assert LLM("random:mingru-tiny", device="cuda", max_num_seqs=4, enforce_eager=True).engine.runner.graphs is None


@pytest.mark.parametrize("preset", [f"random:{name}" for name in PRESETS])
def test_prompts_fed_through_graph_replays_generate_what_prefill_does(preset: str) -> None:
    """Requests arriving while others decode: by default on CUDA their short prompts ride the decode graphs."""
    fed = LLM(preset, device="cuda", dtype="float32", max_num_seqs=40).engine
    prefilled = LLM(preset, device="cuda", dtype="float32", max_num_seqs=40, decoded_prompt_tokens=0).engine
    counts = [count_fed_tokens(engine) for engine in (fed, prefilled)]
    params = [SamplingParams(temperature=0, max_tokens=24), SamplingParams(temperature=0.9, seed=3, max_tokens=24)]
    results = []
    for engine in (fed, prefilled):
        final = {}
        for step in range(400):
            if step < 30:  # one new request per step while the earlier ones decode
                engine.add_request(f"prompt number {step} " * (1 + step % 3), params[step % 2], request_id=str(step))
            final.update({out.request_id: out.outputs[0].token_ids for out in engine.step() if out.finished})
            if step >= 30 and not engine.has_unfinished_requests():
                break
        results.append(final)
    assert len(counts[0]) >= 10 and counts[1] == {}
    assert len(results[0]) == 30 and results[0] == results[1]
