"""Short prompts fed through the decode step (``decoded_prompt_tokens``, on by default where decode replays CUDA
graphs): while samples decode, a prompt with few tokens left joins the decode batch one token per step instead of
costing a prefill call. Forced on here, on the CPU, it must change nothing a caller sees: the same tokens, text,
finish reasons and logprobs as prefill, for every architecture and sampling option, with async scheduling off and
on; prompts that want prompt logprobs still prefill; the prefix cache stores what a fed prompt leaves."""

from __future__ import annotations

import random

import pytest

from rnnserve import SamplingParams
from rnnserve.engine.llm_engine import LLMEngine
from rnnserve.engine.scheduler import SchedulerOutput
from tests.engine.cache_helpers import MODELS, assert_same_outputs, make_engine, random_tokens, run
from tests.engine.test_async_scheduling import assert_same_requests, mixed_params, staggered


def count_fed_tokens(engine: LLMEngine) -> dict[str, int]:
    """Counts, per request, of the prompt tokens the engine's decode steps feed from now on."""
    fed: dict[str, int] = {}
    schedule = engine.scheduler.schedule

    def counting() -> SchedulerOutput:
        out = schedule()
        for chunk in out.decoded_prompts:
            fed[chunk.group.request_id] = fed.get(chunk.group.request_id, 0) + 1
        return out

    engine.scheduler.schedule = counting  # type: ignore[method-assign]
    return fed


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
@pytest.mark.parametrize("model", MODELS)
def test_fed_prompts_generate_what_prefilled_prompts_do(model: str, async_scheduling: str) -> None:
    options = {"max_num_seqs": 6, "max_num_batched_tokens": 24, "async_scheduling": async_scheduling}
    prefilled = make_engine(model, cache=False, decoded_prompt_tokens=0, **options)
    fed = make_engine(model, cache=False, decoded_prompt_tokens=12, **options)
    fed_tokens = count_fed_tokens(fed)
    rng = random.Random(5)
    requests = [  # prompts of 1-30 tokens arriving while others decode: some fed whole, some after chunks
        (random_tokens(rng, prefilled, rng.randint(1, 30)), mixed_params(rng, prefilled, i), rng.randint(0, 12))
        for i in range(18)
    ]
    assert_same_requests(staggered(fed, requests), staggered(prefilled, requests))
    wants_prompt_logprobs = {f"r{i}" for i, (_, params, _) in enumerate(requests) if params.prompt_logprobs}
    assert fed_tokens and not wants_prompt_logprobs & set(fed_tokens)
    fed_lengths = {len(prompt) for i, (prompt, _, _) in enumerate(requests) if f"r{i}" in fed_tokens}
    assert min(fed_lengths) < 12 < max(fed_lengths)  # prompts fed whole, and prompts whose tail was fed after chunks
    assert all(count <= 12 for count in fed_tokens.values())
    assert fed.pool.num_used == 0 and not fed.has_unfinished_requests()


def test_a_prompt_is_fed_only_while_samples_decode() -> None:
    """With nothing decoding, prompts prefill together in one call; a prompt arriving while they decode is fed,
    its first token due in the step that feeds its last prompt token."""
    engine = make_engine("random:mamba-tiny", cache=False, decoded_prompt_tokens=8)
    fed = count_fed_tokens(engine)
    stream = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    rng = random.Random(1)
    for i in range(3):
        engine.add_request(random_tokens(rng, engine, 5), stream, request_id=f"first{i}")
    engine.step()
    assert fed == {} and engine.last_step.prefill_tokens == 15
    engine.add_request(random_tokens(rng, engine, 6), stream, request_id="late")
    outputs = []
    for _ in range(6):
        outputs.append({out.request_id: len(out.outputs[0].token_ids) for out in engine.step()})
    assert fed == {"late": 6}
    assert [o.get("late", 0) for o in outputs] == [0, 0, 0, 0, 0, 1]


def test_the_prefix_cache_keeps_what_a_fed_prompt_left() -> None:
    engine = make_engine("random:mamba2-tiny", cache=True, decoded_prompt_tokens=32)
    reference = make_engine("random:mamba2-tiny", cache=False, decoded_prompt_tokens=0)
    rng = random.Random(2)
    stream = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
    prompt = random_tokens(rng, engine, 20)
    engine.add_request(random_tokens(rng, engine, 4), stream, request_id="stream")
    engine.step()
    fed = count_fed_tokens(engine)
    engine.add_request(prompt, greedy, request_id="fed")
    while "fed" not in {out.request_id for out in engine.step() if out.finished}:
        pass
    assert fed["fed"] == 20
    longer = prompt + random_tokens(rng, engine, 5)
    [resumed] = run(engine, [(longer, greedy)])
    assert resumed.num_cached_tokens >= len(prompt)
    assert_same_outputs([resumed], run(reference, [(longer, greedy)]))
