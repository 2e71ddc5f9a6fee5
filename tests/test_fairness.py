"""Fair prefill: a prompt of 200K tokens must neither hold back a short request's first token nor starve the
streams that are already decoding (issue 13, item 2).

One engine over ``random:mingru-tiny`` (CPU). Unloaded first: a 100-token request's time to first token,
one full prefill chunk (``max_num_batched_tokens`` tokens) and the token rate of two decoding streams. Then
the same while the long prompt prefills (only measurements that end before it is done count). Medians of
several measurements (the machine is noisy); the margins are the acceptance criteria, and the old scheduler
(each step's whole budget to the oldest prompt) misses both by more than 10x.
"""

from __future__ import annotations

import statistics
import time

import pytest

from rnnserve.engine.config import EngineConfig
from rnnserve.engine.llm_engine import LLMEngine
from rnnserve.engine.loader import load_model
from rnnserve.engine.sampling_params import SamplingParams
from rnnserve.engine.sequence import SequenceGroup

LONG_PROMPT = 200_000
SHORT_PROMPT = 100
TRIALS = 5
WINDOW_STEPS = 60

pytestmark = pytest.mark.timeout(300)


def _prompt(length: int, seed: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 256 for i in range(length)]


def _time_to_first_token(engine: LLMEngine, seed: int) -> tuple[float, int]:
    """Add a 100-token request and step until its first token: (seconds, steps)."""
    start = time.perf_counter()
    request_id = engine.add_request(_prompt(SHORT_PROMPT, seed), SamplingParams(temperature=0, max_tokens=1))
    for steps in range(1, 100_000):
        if any(out.request_id == request_id and out.outputs[0].token_ids for out in engine.step()):
            return time.perf_counter() - start, steps
    raise AssertionError("no first token")


def _decode_rate(engine: LLMEngine, streams: list[SequenceGroup]) -> float:
    """Tokens per second that ``streams`` produce over ``WINDOW_STEPS`` engine steps."""
    before = sum(len(s.output_token_ids) for g in streams for s in g.seqs)
    start = time.perf_counter()
    for _ in range(WINDOW_STEPS):
        engine.step()
    return (sum(len(s.output_token_ids) for g in streams for s in g.seqs) - before) / (time.perf_counter() - start)


def _prefill_seconds(engine: LLMEngine, length: int) -> float:
    """Seconds an idle engine takes to prefill a ``length``-token prompt and sample its first token."""
    start = time.perf_counter()
    engine.add_request(_prompt(length, 1), SamplingParams(temperature=0, max_tokens=1))
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - start


def test_long_prompt_neither_delays_first_tokens_nor_starves_decoding_streams() -> None:
    model, tokenizer = load_model("random:mingru-tiny", device="cpu")
    engine = LLMEngine(model, tokenizer, EngineConfig(max_num_seqs=8, max_model_len=2**20))
    chunk = engine.config.max_num_batched_tokens
    for seed in range(2):  # warm-up
        _time_to_first_token(engine, seed)

    unloaded_ttft = statistics.median(_time_to_first_token(engine, seed)[0] for seed in range(TRIALS))
    chunk_seconds = statistics.median(_prefill_seconds(engine, chunk) for _ in range(3))
    stream_params = SamplingParams(temperature=0, max_tokens=100_000, ignore_eos=True)
    for seed in range(2):
        engine.add_request(_prompt(10, seed), stream_params, request_id=f"stream-{seed}")
    streams = list(engine.scheduler.waiting)
    for _ in range(10):
        engine.step()
    unloaded_rate = statistics.median(_decode_rate(engine, streams) for _ in range(TRIALS))

    engine.add_request(_prompt(LONG_PROMPT, 99), SamplingParams(temperature=0, max_tokens=1), request_id="long")
    long_prompt = engine.scheduler.waiting[0]
    for _ in range(10):
        engine.step()
    rates, loaded = [], []
    for seed in range(TRIALS):  # only measurements taken while the long prompt still prefills count
        rate = _decode_rate(engine, streams)
        rates += [rate] if not long_prompt.prefill_done else []
        ttft = _time_to_first_token(engine, seed)
        loaded += [ttft] if not long_prompt.prefill_done else []
    loaded_rate = statistics.median(rates) if rates else 0.0
    loaded_ttft = statistics.median(seconds for seconds, _ in loaded) if loaded else float("inf")

    print(
        f"unloaded TTFT {unloaded_ttft * 1e3:.1f} ms, loaded {loaded_ttft * 1e3:.1f} ms "
        f"(steps {[steps for _, steps in loaded]}), one {chunk}-token chunk {chunk_seconds * 1e3:.1f} ms; "
        f"stream rate unloaded {unloaded_rate:.0f} tok/s, loaded {loaded_rate:.0f} tok/s "
        f"({loaded_rate / unloaded_rate:.0%}); long prompt prefilled {long_prompt.num_prefilled} tokens"
    )
    assert loaded_rate >= 0.5 * unloaded_rate
    assert [steps for _, steps in loaded] == [1] * TRIALS, "a short prompt waited for the long one"
    assert loaded_ttft <= 2 * unloaded_ttft + chunk_seconds
