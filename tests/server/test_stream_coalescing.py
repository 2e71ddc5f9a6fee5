"""A stream that falls behind the engine catches up with chunks of several tokens (outputs merged), and what
it delivers is exactly what it would have delivered one token per chunk."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from fastapi.testclient import TestClient

from rnnserve.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput, TokenLogprob, merge_deltas
from rnnserve.server.app import create_app
from rnnserve.server.async_engine import AsyncEngine, Submission
from tests.server.conftest import tiny_config

pytestmark = pytest.mark.timeout(90)


def delta(request_id: str, token: int, finish: str | None = None, error: str | None = None) -> RequestOutput:
    logprob = TokenLogprob(token, -0.5 * token)
    sample = CompletionOutput(0, f"<{token}>", [token], finish, [logprob], -float(token), f"<{token}>", [token],
                              [logprob], token)  # fmt: skip
    return RequestOutput(request_id, "p", [1, 2], [sample], finish is not None or error is not None,
                         RequestMetrics(float(token)), error)  # fmt: skip


def test_merge_deltas_joins_what_both_steps_added_and_keeps_the_later_state() -> None:
    merged = merge_deltas(delta("r", 1), delta("r", 2, "length"))
    (sample,) = merged.outputs
    assert (sample.text, sample.text_delta) == ("<1><2>", "<1><2>")
    assert sample.token_ids == sample.new_token_ids == [1, 2]
    assert [e.token_id for e in sample.logprobs or []] == [e.token_id for e in sample.new_logprobs] == [1, 2]
    assert (sample.finish_reason, sample.num_tokens, sample.cumulative_logprob) == ("length", 2, -2.0)
    assert merged.finished and merged.metrics.arrival_time == 2.0


class NoBridge:
    def abort(self, submission: Submission) -> None:
        pass


def read_all(submission: Submission, items: list) -> list:
    async def run() -> list:
        for item in items:
            submission.put(item)
        return [out async for out in submission.outputs()]

    return asyncio.run(run())


def test_queued_outputs_of_a_request_are_read_as_one() -> None:
    async def make() -> Submission:
        return Submission(NoBridge(), "s", ["a", "b"], 0, coalesce=True)  # type: ignore[arg-type]

    outs = read_all(asyncio.run(make()), [delta("a", 1), delta("a", 2), delta("b", 3), delta("b", 4, "stop"),
                                          delta("a", 5), delta("a", 6, "length")])  # fmt: skip
    assert [(o.request_id, o.outputs[0].new_token_ids, o.finished) for o in outs] == [
        ("a", [1, 2], False), ("b", [3, 4], True), ("a", [5, 6], True)
    ]


def test_an_unread_stream_keeps_its_backlog_merged() -> None:
    """A client that reads nothing: its outputs were queued one object per step (38 MB for 30,000 tokens);
    beyond a short backlog they are merged as they come, and the reader still gets every token once."""
    from rnnserve.server.async_engine import COALESCE_BACKLOG

    async def run() -> tuple[int, list[RequestOutput]]:
        submission = Submission(NoBridge(), "s", ["a"], 0, coalesce=True)  # type: ignore[arg-type]
        for token in range(1, 1000):
            submission.put(delta("a", token))
        submission.put(delta("a", 1000, "length"))
        queued = len(submission._items)
        return queued, [out async for out in submission.outputs()]

    queued, outs = asyncio.run(run())
    assert queued == COALESCE_BACKLOG
    assert [t for o in outs for t in o.outputs[0].new_token_ids] == list(range(1, 1001)) and outs[-1].finished


def test_an_error_output_is_never_merged() -> None:
    async def make() -> Submission:
        return Submission(NoBridge(), "s", ["a"], 0, coalesce=True)  # type: ignore[arg-type]

    with pytest.raises(Exception, match="boom"):
        read_all(asyncio.run(make()), [delta("a", 1), delta("a", 2), delta("a", 3, error="boom")])


def test_without_coalescing_each_output_is_read_alone() -> None:
    async def make() -> Submission:
        return Submission(NoBridge(), "s", ["a"], 0)  # type: ignore[arg-type]

    outs = read_all(asyncio.run(make()), [delta("a", 1), delta("a", 2), delta("a", 3, "stop")])
    assert [o.outputs[0].new_token_ids for o in outs] == [[1], [2], [3]]


def test_a_stream_behind_the_engine_gets_multi_token_chunks_with_the_same_content(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real_route = AsyncEngine._route

    def busy_route(self: AsyncEngine, outputs: list[RequestOutput]) -> None:
        time.sleep(0.01)  # an event loop busy with other streams: the engine runs ahead
        real_route(self, outputs)

    monkeypatch.setattr(AsyncEngine, "_route", busy_route)
    body = {"prompt": "Hello", "max_tokens": 64, "ignore_eos": True, "temperature": 0, "logprobs": 1}
    with TestClient(create_app(tiny_config())) as client:
        whole = client.post("/v1/completions", json=body).json()
        stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
        with client.stream("POST", "/v1/completions", json=stream) as response:
            events = [line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    tokens_per_chunk = [len(c["logprobs"]["tokens"]) for c in choices]
    assert max(tokens_per_chunk) > 1 and sum(tokens_per_chunk) == 64
    assert chunks[-1]["usage"]["completion_tokens"] == 64
    assert "".join(c["text"] for c in choices) == whole["choices"][0]["text"]
    streamed_offsets = [o for c in choices for o in c["logprobs"]["text_offset"]]
    assert streamed_offsets == whole["choices"][0]["logprobs"]["text_offset"]
    assert choices[-1]["finish_reason"] == "length"
