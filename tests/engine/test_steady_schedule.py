"""A steady decode batch is scheduled without a pass over its samples: every schedule must still pick exactly
the samples the full rule picks, admit what fits and prefill what waits, through arrivals, prompts longer than
a step's budget, ends by EOS, stop tokens and ``max_tokens``, ``n > 1`` and aborts, with async scheduling off
and on."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from rnnserve.engine.llm_engine import LLMEngine
from rnnserve.engine.sampling_params import SamplingParams
from rnnserve.engine.sequence import Sequence
from tests.engine.conftest import make_engine, run_to_completion

MODES = ["off", "on"]


def decode_by_rule(engine: LLMEngine) -> list[Sequence]:
    """The samples a schedule decodes, by the rule itself: every sample of a running request whose prompt is
    done that has not ended and may sample another token (its in-flight token, if any, is not its last)."""
    return [
        s
        for g in engine.scheduler.running.values()
        if g.num_prefilled >= len(g.prompt_token_ids)
        for s in g.seqs
        if s.finish_reason is None and len(s.output_token_ids) + s.num_pending < s.max_tokens
    ]


def check_every_schedule(engine: LLMEngine) -> Counter[str]:
    """Check each of ``engine``'s schedules against the rule; the returned counts say how many were checked
    and how many returned the steady batch unchanged."""
    scheduler = engine.scheduler
    schedule = scheduler.schedule
    counts: Counter[str] = Counter()

    def checked_schedule():  # type: ignore[no-untyped-def]
        expected = decode_by_rule(engine)  # admission comes after the running samples are picked
        prompting = any(g.num_prefilled < len(g.prompt_token_ids) for g in scheduler.running.values())
        steady_before = scheduler._steady
        batch = schedule()
        assert batch.decode == expected
        waiting = scheduler.waiting
        assert not (waiting and scheduler.pool.num_free >= waiting[0].params.n), "a request that fits waits"
        if steady_before is not None and batch.decode is steady_before:
            assert not prompting and not batch.prefill, "a prompt was left out of the step"
            counts["reused"] += 1
        counts["checked"] += 1
        return batch

    scheduler.schedule = checked_schedule  # type: ignore[method-assign]
    return counts


@pytest.mark.parametrize("async_scheduling", MODES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_schedule_decodes_what_the_rule_picks(async_scheduling: str, seed: int) -> None:
    rng = random.Random(seed)
    engine = make_engine(max_num_seqs=8, max_num_batched_tokens=16, async_scheduling=async_scheduling)
    counts = check_every_schedule(engine)
    arrivals = {step: rng.randint(1, 3) for step in rng.sample(range(60), 12)}
    live: list[str] = []
    for step in range(400):
        for _ in range(arrivals.get(step, 0)):
            params = SamplingParams(
                temperature=0,
                max_tokens=rng.randint(1, 40),
                n=rng.choice([1, 1, 2]),
                stop_token_ids=rng.sample(range(256), 48) if rng.random() < 0.5 else [],
                ignore_eos=rng.random() < 0.5,
            )
            live.append(engine.add_request([rng.randrange(256) for _ in range(rng.randint(1, 40))], params))
        if step % 7 == 6 and live:  # mostly running requests, in the middle of a steady batch or not
            engine.abort_request(live.pop(rng.randrange(len(live))))
        if step > 60 and not engine.has_unfinished_requests():
            break
        engine.step()
    assert not engine.has_unfinished_requests()
    assert engine.scheduler.pool.num_used == 0
    assert counts["checked"] > counts["reused"]


@pytest.mark.parametrize("async_scheduling", MODES)
def test_a_steady_batch_changes_when_a_sample_stops_is_aborted_or_joins(async_scheduling: str) -> None:
    prompt = [7, 8, 9]
    probe = make_engine()
    probe.add_request(prompt, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), request_id="probe")
    tokens = run_to_completion(probe)["probe"].outputs[0].token_ids
    stop_at = next(i for i in range(3, 10) if tokens[i] not in tokens[:i])  # a token first sampled there
    engine = make_engine(max_num_seqs=8, async_scheduling=async_scheduling)
    counts = check_every_schedule(engine)
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    stop = SamplingParams(temperature=0, max_tokens=200, stop_token_ids=[tokens[stop_at]])
    stopping = engine.add_request(prompt, stop)
    aborted = engine.add_request([1, 2], long)
    engine.add_request([3, 4], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, n=2))
    engine.add_request([5], SamplingParams(temperature=0, max_tokens=23, ignore_eos=True))
    for _ in range(12):
        engine.step()
    assert stopping not in engine.scheduler.running  # it stopped at its stop token
    engine.abort_request(aborted)
    for _ in range(3):
        engine.step()
    engine.add_request([6], long)  # joins a steady batch
    for _ in range(30):
        engine.step()
    assert counts["reused"] >= 20
