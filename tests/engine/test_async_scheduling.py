"""Async scheduling (on by default on CUDA): each step is queued before the previous step's tokens are read, so
the samples of that step run once more even if they just finished. Forced on here, on the CPU, it must change
nothing a caller sees: the same tokens, text, finish reasons and logprobs as the synchronous engine, under every
sampling option that reads earlier tokens (penalties, min_tokens, seeds, stops), chunked prefill, ``n > 1``,
aborts and staggered arrivals; and a finished request's saved state (prefix cache, ``final_state``) still
continues exactly."""

from __future__ import annotations

import random
import time
from typing import Any

import pytest

from rnnserve import SamplingParams
from rnnserve.engine.llm_engine import LLMEngine
from rnnserve.engine.outputs import RequestOutput
from rnnserve.engine.sampler import SampledTokens
from rnnserve.engine.sampling_params import InvalidParameterError
from tests.engine.cache_helpers import assert_same_outputs, make_engine, random_tokens, run, token_pool
from tests.engine.conftest import run_to_completion

MODELS = [
    "random:mingru-tiny", "random:mamba-tiny", "random:mamba2-tiny", "random:griffin-tiny", "random:based-tiny",
    "random:lattice-tiny", "random:looped-tiny", "random:lstm-tiny", "lsrl:majority",
]  # fmt: skip


def mixed_params(rng: random.Random, engine: LLMEngine, index: int) -> SamplingParams:
    """One request's sampling options, cycling through the ones whose result depends on earlier tokens."""
    pool = token_pool(engine)
    stops = rng.sample(pool, max(1, len(pool) // 3))  # a third of the vocabulary: most requests stop early
    common = {"max_tokens": rng.randint(3, 12), "ignore_eos": True}
    choices = [
        SamplingParams(temperature=0, logprobs=2, **common),
        SamplingParams(temperature=0.8, top_p=0.9, seed=index, n=2, **common),
        SamplingParams(temperature=0, stop_token_ids=stops, min_tokens=3, **common),
        SamplingParams(temperature=1.0, seed=index, repetition_penalty=1.3, frequency_penalty=0.5, **common),
        SamplingParams(temperature=0, stop=[engine.tokenizer.decode([t]) for t in stops[:3]], prompt_logprobs=1,
                       **common),
        SamplingParams(temperature=0.7, top_k=5, seed=index, stop_token_ids=stops, logprobs=1, **common),
    ]
    return choices[index % len(choices)]


def staggered(engine: LLMEngine, requests: list[tuple[list[int], SamplingParams, int]]) -> dict[str, RequestOutput]:
    """Add each request once the engine has taken ``arrival`` steps; run all to completion."""
    pending = sorted(enumerate(requests), key=lambda item: item[1][2])
    final: dict[str, RequestOutput] = {}
    steps = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][1][2] <= steps:
            index, (prompt, params, _) = pending.pop(0)
            engine.add_request(prompt, params, request_id=f"r{index}")
        for out in engine.step():
            assert out.error is None
            if out.finished:
                final[out.request_id] = out
        steps += 1
        assert steps < 2000
    return final


def assert_same_prompt_logprobs(out: RequestOutput, expected: RequestOutput) -> None:
    """The same prompt tokens, ranks and alternatives, log-probabilities up to fp32 rounding (the prompt may be
    packed with other prompts differently)."""
    if expected.prompt_logprobs is None:
        assert out.prompt_logprobs is None
        return
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(expected.prompt_logprobs)
    for got, ref in zip(out.prompt_logprobs[1:], expected.prompt_logprobs[1:], strict=True):
        assert got is not None and ref is not None
        assert (got.token_id, got.rank, [t for t, _ in got.top]) == (ref.token_id, ref.rank, [t for t, _ in ref.top])
        assert got.logprob == pytest.approx(ref.logprob, abs=1e-4)


def assert_same_requests(got: dict[str, RequestOutput], expected: dict[str, RequestOutput]) -> None:
    """The same requests with the same text, finish reasons, tokens, logprobs and prompt logprobs."""
    assert sorted(got) == sorted(expected)
    for request_id, out in got.items():
        assert [(s.text, s.finish_reason) for s in out.outputs] == [
            (s.text, s.finish_reason) for s in expected[request_id].outputs
        ]
        assert_same_outputs([out], [expected[request_id]])
        assert_same_prompt_logprobs(out, expected[request_id])


@pytest.mark.parametrize("model", MODELS)
def test_async_scheduling_generates_what_the_synchronous_engine_does(model: str) -> None:
    options = {"max_num_seqs": 6, "max_num_batched_tokens": 24}  # few slots and chunked prompts: requests queue
    sync = make_engine(model, cache=False, async_scheduling="off", **options)
    ahead = make_engine(model, cache=False, async_scheduling="on", **options)
    assert ahead.async_scheduling and not sync.async_scheduling
    rng = random.Random(3)
    requests = [
        (random_tokens(rng, sync, rng.randint(1, 40)), mixed_params(rng, sync, i), rng.randint(0, 12))
        for i in range(18)
    ]
    expected, got = staggered(sync, requests), staggered(ahead, requests)
    assert_same_requests(got, expected)
    reasons = {s.finish_reason for out in got.values() for s in out.outputs}
    assert reasons == {"stop", "length"}  # both ways of finishing were exercised
    assert ahead.pool.num_used == 0 and not ahead.has_unfinished_requests()


def test_a_stopped_request_saves_the_state_its_last_step_left() -> None:
    """A request that stops on a token (unknown until it is read) ran once more: its saved state has consumed
    its whole output, so ``final_state`` has no pending token and the prefix cache holds prompt + output; both
    continue exactly like the synchronous engine's state, which has the last token still to consume."""
    model = "random:mamba-tiny"
    engines = {mode: make_engine(model, cache=True, async_scheduling=mode) for mode in ("off", "on")}
    reference = make_engine(model, cache=False)
    rng = random.Random(5)
    pool = token_pool(reference)
    prompt = random_tokens(rng, reference, 11)
    first = run(reference, [(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))])[0]
    stop_at = first.outputs[0].token_ids[4]  # the greedy output stops at its fifth token
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop_token_ids=[stop_at])
    follow_up = random_tokens(rng, reference, 6)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
    for mode, engine in engines.items():
        request_id = engine.add_request(prompt, params, return_state=True)
        out = run_to_completion(engine)[request_id]
        tokens = out.outputs[0].token_ids
        assert out.outputs[0].finish_reason == "stop" and tokens[-1] == stop_at and len(tokens) <= 5
        state = out.final_state
        assert state is not None and state.history_token_ids == prompt + tokens
        assert state.pending_token_ids == ([] if mode == "on" else tokens[-1:])
        if mode == "on":  # nothing left to prefill: an empty continuation has no logits to start from
            with pytest.raises(InvalidParameterError, match="prompt is empty"):
                engine.add_request([], greedy, context=state)
        else:
            engine.abort_request(engine.add_request([], greedy, context=state))
        history = prompt + tokens + follow_up
        expected = run(reference, [(history, greedy)])
        request_id = engine.add_request(follow_up, greedy, context=state)
        assert_same_outputs([run_to_completion(engine)[request_id]], expected)
        cached = run(engine, [(history, greedy)])[0]
        assert cached.num_cached_tokens == len(state.token_ids)
        assert_same_outputs([cached], expected)
        assert set(pool) >= set(tokens)


def test_aborting_a_request_whose_token_is_in_flight() -> None:
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    engine = make_engine("random:mingru-tiny", cache=False, async_scheduling="on")
    sync = make_engine("random:mingru-tiny", cache=False, async_scheduling="off")
    prompts = {name: random_tokens(random.Random(i), engine, 7) for i, name in enumerate(("a", "b", "c"))}
    for name, prompt in prompts.items():
        engine.add_request(prompt, params, request_id=name)
    for _ in range(4):
        engine.step()
    aborted = engine.abort_request("b")
    assert aborted is not None and aborted.finished and aborted.outputs[0].finish_reason == "abort"
    assert len(aborted.outputs[0].token_ids) == 3  # four steps sampled four tokens: three read, one in flight
    final = run_to_completion(engine)
    expected = run(sync, [(prompts["a"], params), (prompts["c"], params)])
    assert_same_outputs([final["a"], final["c"]], expected)
    assert "b" not in final and engine.pool.num_used == 0
    for name, prompt in prompts.items():
        engine.add_request(prompt, params, request_id=f"{name}2")
    engine.step()
    engine.step()
    for name in prompts:
        engine.abort_request(f"{name}2")
    assert not engine.has_unfinished_requests() and engine.pool.num_used == 0
    assert engine.step() == []  # the step in flight had only aborted requests: nothing to report


class WaitingEvent:
    """A CUDA event's stand-in whose ``synchronize`` takes :data:`DEVICE_WAIT` seconds, as the device's step would."""

    def synchronize(self) -> None:
        time.sleep(DEVICE_WAIT)


DEVICE_WAIT = 0.002


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_a_step_counts_its_wait_for_the_device(async_scheduling: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``StepStats.device_wait_seconds``: the time the step waited for its sampled tokens (with async scheduling,
    the previous step's); nothing on the CPU, where they are ready when sampled."""
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)

    def run_waits(engine: LLMEngine) -> list[tuple[int, float]]:
        engine.add_request([1, 2, 3], params, request_id="r")
        waits = []
        while engine.has_unfinished_requests():
            engine.step()
            waits.append((engine.last_step.generated_tokens, engine.last_step.device_wait_seconds))
        return waits

    on_cpu = run_waits(make_engine("random:mingru-tiny", False, async_scheduling=async_scheduling))
    assert sum(tokens for tokens, _ in on_cpu) == 5 and all(wait == 0.0 for _, wait in on_cpu)
    init = SampledTokens.__init__

    def with_event(self: SampledTokens, *args: Any) -> None:
        init(self, *args)
        self._ready = WaitingEvent()  # type: ignore[assignment]

    monkeypatch.setattr(SampledTokens, "__init__", with_event)
    waited = run_waits(make_engine("random:mingru-tiny", False, async_scheduling=async_scheduling))
    assert [tokens for tokens, _ in waited] == [tokens for tokens, _ in on_cpu]
    assert all(wait >= DEVICE_WAIT if tokens else wait == 0.0 for tokens, wait in waited)
