"""Fair prefill: a short prompt is never held behind a long one, and while samples decode a long prompt gets
bounded chunks within a share of the engine's time. Step times are fed to the scheduler by hand here, so the
decisions are deterministic."""

from __future__ import annotations

from rnnserve.engine.llm_engine import LLMEngine
from rnnserve.engine.sampling_params import SamplingParams
from rnnserve.engine.scheduler import SchedulerOutput
from tests.engine.conftest import make_engine

GREEDY = SamplingParams(temperature=0, max_tokens=1)
STREAM = SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True)


def _step(engine: LLMEngine, seconds: float) -> SchedulerOutput:
    """Schedule one step, record its prefill as done and account ``seconds`` for it (no model call)."""
    batch = engine.scheduler.schedule()
    engine.scheduler.complete_prefill(batch.prefill)
    engine.scheduler.record_step(batch, seconds)
    return batch


def _tokens(batch: SchedulerOutput) -> dict[str, int]:
    return {c.group.request_id: c.end - c.start for c in batch.prefill}


def test_short_prompt_is_prefilled_in_the_step_after_it_arrives() -> None:
    engine = make_engine(max_num_batched_tokens=64)
    engine.add_request("x" * 1000, GREEDY, request_id="long")
    assert _tokens(_step(engine, 0.01)) == {"long": 64}  # alone: the whole budget
    engine.add_request("y" * 10, GREEDY, request_id="short")
    assert _tokens(_step(engine, 0.01)) == {"short": 10, "long": 54}


def test_short_prompt_gets_its_first_token_while_a_long_prompt_prefills() -> None:
    engine = make_engine(max_num_batched_tokens=64)
    engine.add_request("x" * 1000, GREEDY, request_id="long")
    engine.step()
    engine.add_request("y" * 10, GREEDY, request_id="short")
    first = {out.request_id: out.outputs[0].token_ids for out in engine.step()}
    assert len(first.get("short", [])) == 1 and "long" not in first


def test_while_samples_decode_a_long_prompt_gets_bounded_chunks_within_its_time_share() -> None:
    engine = make_engine(max_num_batched_tokens=512, long_prefill_token_threshold=32, prefill_time_share=0.5)
    engine.add_request("s", STREAM, request_id="stream")
    _step(engine, 0.001)
    engine.add_request("x" * 1000, GREEDY, request_id="long")
    batch = _step(engine, 0.011)
    assert len(batch.decode) == 1 and _tokens(batch) == {"long": 32}
    # The 11 ms prefill step is owed to the stream: at share 0.5, ~11 ms of decode-only steps of 1 ms each.
    waited = 0
    while not (batch := _step(engine, 0.001)).prefill:
        assert len(batch.decode) == 1
        waited += 1
    assert 10 <= waited <= 14 and _tokens(batch) == {"long": 32}


def test_a_short_prompt_does_not_wait_for_the_time_share() -> None:
    engine = make_engine(max_num_batched_tokens=512, long_prefill_token_threshold=32, prefill_time_share=0.5)
    engine.add_request("s", STREAM, request_id="stream")
    _step(engine, 0.001)
    engine.add_request("x" * 1000, GREEDY, request_id="long")
    _step(engine, 0.1)  # deep in debt: the long prompt waits
    engine.add_request("y" * 20, GREEDY, request_id="short")
    assert _tokens(_step(engine, 0.002)) == {"short": 20}
    assert _step(engine, 0.001).prefill == []


def test_partial_prefills_are_bounded_and_the_oldest_prompt_always_advances() -> None:
    engine = make_engine(
        max_num_batched_tokens=512, long_prefill_token_threshold=32, max_num_partial_prefills=2,
        prefill_time_share=1.0,
    )
    engine.add_request("s", STREAM, request_id="stream")
    _step(engine, 0.001)
    for name, length in [("oldest", 900), ("mid", 300), ("newest", 100)]:
        engine.add_request("x" * length, GREEDY, request_id=name)
    assert _tokens(_step(engine, 0.01)) == {"oldest": 32, "newest": 32}
    engine.add_request("y" * 5, GREEDY, request_id="short")
    assert _tokens(_step(engine, 0.01)) == {"short": 5, "oldest": 32, "newest": 32}


def test_without_decoding_samples_prefill_is_not_throttled() -> None:
    engine = make_engine(max_num_batched_tokens=512, long_prefill_token_threshold=32, prefill_time_share=0.1)
    engine.add_request("x" * 1000, GREEDY, request_id="long")
    assert [sum(_tokens(_step(engine, 1.0)).values()) for _ in range(2)] == [512, 488]


def test_short_prompts_arriving_all_the_time_do_not_starve_a_long_prompt() -> None:
    """Short prompts' prefill counts against the time share, and on a CPU one costs many decode steps: arriving
    every step or two they kept the share in debt, and a long prompt got no token at all however long it
    waited. Its own account earns from every step it is not in, so it still gets about its share of the time."""
    share = 0.3
    engine = make_engine(max_num_batched_tokens=512, long_prefill_token_threshold=32, prefill_time_share=share)
    engine.add_request("s", STREAM, request_id="stream")
    _step(engine, 0.001)
    engine.add_request("x" * 2000, GREEDY, request_id="long")
    long_seconds = total_seconds = 0.0
    for i in range(300):
        if i % 2 == 0:
            engine.add_request("y" * 16, GREEDY, request_id=f"short{i}")
        batch = engine.scheduler.schedule()
        tokens = _tokens(batch)
        seconds = 0.001 + 0.02 * bool(batch.prefill) + 0.02 * ("long" in tokens)
        engine.scheduler.complete_prefill(batch.prefill)
        engine.scheduler.record_step(batch, seconds)
        for chunk in batch.prefill:
            if chunk.group.prefill_done:
                engine.scheduler.abort(chunk.group.request_id)
        assert all(n <= 32 for n in tokens.values())
        total_seconds += seconds
        long_seconds += 0.02 * ("long" in tokens)
    assert engine.scheduler.running["long"].num_prefilled >= 32 * 20
    assert 0.3 * share <= long_seconds / total_seconds <= share
