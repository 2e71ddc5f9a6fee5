"""Fair prefill: a prompt of 200K tokens must neither hold back a short request's first token nor starve the
streams that are already decoding (issue 13, item 2).

Two engines over ``random:mingru-tiny`` (CPU), each with two decoding streams; one also prefills the long
prompt. They take turns: each measures its streams' token rate over a window of steps and a 100-token
request's time to first token, so a change in the machine's load between measurements touches both sides
(only measurements that end before the long prompt is done count). Medians of several turns (the machine
is noisy); the margins are the acceptance criteria, and the old scheduler (each step's whole budget to the
oldest prompt) misses both by more than 10x. With the default ``prefill_time_share`` of 0.3 the loaded
streams keep about 70% of their rate.
"""

from __future__ import annotations

import statistics
import time

import pytest

from rnnserve.engine.config import EngineConfig
from rnnserve.engine.llm_engine import LLMEngine
from rnnserve.engine.loader import load_model
from rnnserve.engine.models.base import RecurrentLM
from rnnserve.engine.sampling_params import SamplingParams
from rnnserve.engine.sequence import SequenceGroup
from rnnserve.engine.tokenizer import Tokenizer

LONG_PROMPT = 200_000
SHORT_PROMPT = 100
TRIALS = 9
WINDOW_STEPS = 200

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


def _engine(model: RecurrentLM, tokenizer: Tokenizer) -> LLMEngine:
    engine = LLMEngine(model, tokenizer, EngineConfig(max_num_seqs=8, max_model_len=2**20))
    for seed in range(2):  # warm-up
        _time_to_first_token(engine, seed)
    return engine


def _start_streams(engine: LLMEngine) -> list[SequenceGroup]:
    """Start two long decoding streams on ``engine``."""
    stream_params = SamplingParams(temperature=0, max_tokens=100_000, ignore_eos=True)
    for seed in range(2):
        engine.add_request(_prompt(10, seed), stream_params, request_id=f"stream-{seed}")
    streams = list(engine.scheduler.waiting)
    for _ in range(10):
        engine.step()
    return streams


def test_long_prompt_neither_delays_first_tokens_nor_starves_decoding_streams() -> None:
    model, tokenizer = load_model("random:mingru-tiny", device="cpu")
    quiet, loaded = _engine(model, tokenizer), _engine(model, tokenizer)
    chunk = quiet.config.max_num_batched_tokens
    chunk_seconds = statistics.median(_prefill_seconds(quiet, chunk) for _ in range(3))
    quiet_streams, loaded_streams = _start_streams(quiet), _start_streams(loaded)
    loaded.add_request(_prompt(LONG_PROMPT, 99), SamplingParams(temperature=0, max_tokens=1), request_id="long")
    long_prompt = loaded.scheduler.waiting[0]
    for _ in range(10):
        loaded.step()

    # The two engines take turns, so a change in the machine's load between measurements touches both sides;
    # only measurements taken while the long prompt still prefills count.
    ratios, quiet_ttft, loaded_ttft = [], [], []
    for seed in range(TRIALS):
        quiet_rate = _decode_rate(quiet, quiet_streams)
        loaded_rate = _decode_rate(loaded, loaded_streams)
        quiet_ttft.append(_time_to_first_token(quiet, seed))
        ttft = _time_to_first_token(loaded, seed)
        if not long_prompt.prefill_done:
            ratios.append(loaded_rate / quiet_rate)
            loaded_ttft.append(ttft)
    rate_ratio = statistics.median(ratios) if ratios else 0.0
    unloaded = statistics.median(seconds for seconds, _ in quiet_ttft)
    with_long = statistics.median(seconds for seconds, _ in loaded_ttft) if loaded_ttft else float("inf")

    print(
        f"TTFT unloaded {unloaded * 1e3:.1f} ms, loaded {with_long * 1e3:.1f} ms (steps "
        f"{[steps for _, steps in loaded_ttft]}), one {chunk}-token chunk {chunk_seconds * 1e3:.1f} ms; loaded/"
        f"unloaded stream rate {[f'{r:.0%}' for r in ratios]} (median {rate_ratio:.0%}); long prompt prefilled "
        f"{long_prompt.num_prefilled} tokens"
    )
    assert rate_ratio >= 0.5
    assert [steps for _, steps in loaded_ttft] == [1] * TRIALS, "a short prompt waited for the long one"
    assert with_long <= 2 * unloaded + chunk_seconds
