"""A stream's plain chunks (one choice of text, no finish, no logprobs) are written from prebuilt parts around
the delta's JSON string: byte for byte what the choice dicts give, whatever the text holds."""

from __future__ import annotations

import asyncio
import json

import pytest

from rnnserve.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput, TokenLogprob
from rnnserve.engine.sampling_params import SamplingParams
from rnnserve.engine.tokenizer import ByteTokenizer
from rnnserve.server.protocol import ChatCompletionRequest, CompletionRequest
from rnnserve.server.streaming import ChatStream, CompletionStream, Generation
from tests.server.test_stream_batching import QueuedSubmission, sent_writes

# Deltas a JSON writer can get wrong: quotes and backslashes, control characters, the line breaks that JSON allows
# raw but some SSE readers split on, non-ASCII text, emoji beyond the BMP, empty text.
DELTAS = ['He said "hi"', "back\\slash", "tab\there", "new\nline\r", "\x00\x01\x1f\x7f", "\u2028 \u2029 \x85",
          "é ü ß", "日本語", "😀👍🏽", "", "</script>", "a"]  # fmt: skip


def samples(step: int, n: int, last: bool, logprobs: bool = False) -> list[CompletionOutput]:
    delta = DELTAS[step % len(DELTAS)]
    entries = [TokenLogprob(step, -0.5, [(step, -0.5)])] if logprobs else []
    return [
        CompletionOutput(index=i, text="", token_ids=[], finish_reason="length" if last else None, logprobs=None,
                         cumulative_logprob=0.0, text_delta=delta, new_token_ids=[step], new_logprobs=entries)
        for i in range(n)
    ]  # fmt: skip


def submission(steps: int, n: int = 1, logprobs: bool = False) -> QueuedSubmission:
    outputs = [RequestOutput("r0", "p", [1], samples(i, n, i == steps - 1, logprobs), i == steps - 1,
                             RequestMetrics(0.0)) for i in range(steps)]  # fmt: skip
    return QueuedSubmission(outputs)


def written(stream: Generation) -> str:
    """Everything the stream writes, its outputs read one by one (each a write of its own)."""

    async def run() -> list[str]:
        submission = stream.submission
        submission.has_queued = lambda: False  # type: ignore[method-assign]
        return await sent_writes(stream)

    return "".join(asyncio.run(run()))


def make_stream(kind: str, n: int = 1, logprobs: bool = False, **options: object) -> Generation:
    steps = len(DELTAS) + 2
    params = SamplingParams(max_tokens=steps, n=n, logprobs=1 if logprobs else None)
    if kind == "chat":
        req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], stream=True, **options)
        return ChatStream(ByteTokenizer(), submission(steps, n, logprobs), req, "m", params)
    req = CompletionRequest(prompt="p", stream=True, **options)
    return CompletionStream(ByteTokenizer(), submission(steps, n, logprobs), req, "m", params)


def without_plain_chunks(stream: Generation, monkeypatch: pytest.MonkeyPatch) -> Generation:
    """``stream`` with every chunk written from its choice dicts."""
    monkeypatch.setattr(stream, "plain_chunk_parts", lambda *_: None)
    stream.plain_parts = None
    return stream


def same_but_ids(a: str, b: str) -> None:
    """``a`` and ``b`` equal once each event's ``id`` and ``created`` are set aside."""
    events_a, events_b = a.split("\n\n"), b.split("\n\n")
    assert len(events_a) == len(events_b)
    for x, y in zip(events_a, events_b, strict=True):
        if x.startswith("data: {"):
            bx, by = json.loads(x.removeprefix("data: ")), json.loads(y.removeprefix("data: "))
            assert (bx.pop("id"), bx.pop("created")) and (by.pop("id"), by.pop("created"))
            assert bx == by
            head_x, head_y = x.split('"object"', 1)[1], y.split('"object"', 1)[1]
            assert head_x.split('"model"', 1)[1] == head_y.split('"model"', 1)[1]  # the text after the id and time
        else:
            assert x == y


@pytest.mark.parametrize("kind", ["completions", "chat"])
@pytest.mark.parametrize("usage", [False, True])
def test_plain_chunks_are_the_choice_dicts_written_byte_for_byte(
    kind: str, usage: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    options = {"stream_options": {"include_usage": True}} if usage else {}
    plain = make_stream(kind, **options)
    text = written(plain)
    assert plain.plain_parts is not None  # the direct path was taken
    reference = without_plain_chunks(make_stream(kind, **options), monkeypatch)
    reference_text = written(reference)
    assert reference.plain_parts is None
    same_but_ids(text, reference_text)
    # The same bytes, but for the id and the creation time
    assert text.replace(plain.submission.request_id, "ID").replace(str(plain.created), "T") == (
        reference_text.replace(reference.submission.request_id, "ID").replace(str(reference.created), "T")
    )
    events = [json.loads(e.removeprefix("data: ")) for e in text.split("\n\n") if e.startswith("data: {")]
    field = "text" if kind == "completions" else "delta"
    deltas = [c[field] if kind == "completions" else c[field].get("content") for e in events for c in e["choices"]]
    assert deltas[kind == "chat" :][: len(DELTAS)] == DELTAS  # (chat's first chunk has the role)
    for event in text.split("\n\n")[:-1]:
        assert "\n" not in event and "\r" not in event and "\u2028" not in event and "\x85" not in event
    if usage:
        assert all("usage" in e for e in events) and events[-1]["usage"]["completion_tokens"] == 0
    assert events[-1 - usage]["choices"][0]["finish_reason"] == "length"  # the finish chunk: the dicts' path


@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_streams_that_are_not_plain_keep_the_choice_dicts(kind: str) -> None:
    many = make_stream(kind, n=2)
    text = written(many)
    assert many.plain_parts is None
    events = [json.loads(e.removeprefix("data: ")) for e in text.split("\n\n") if e.startswith("data: {")]
    assert {c["index"] for e in events for c in e["choices"]} == {0, 1}
    with_logprobs = make_stream(kind, logprobs=True)
    text = written(with_logprobs)
    assert with_logprobs.plain_parts is None
    events = [json.loads(e.removeprefix("data: ")) for e in text.split("\n\n") if e.startswith("data: {")]
    assert all(c["logprobs"] is not None for e in events[kind == "chat" :] for c in e["choices"])
    continuous = make_stream(kind, stream_options={"include_usage": True, "continuous_usage_stats": True})
    text = written(continuous)
    assert continuous.plain_parts is None
    events = [json.loads(e.removeprefix("data: ")) for e in text.split("\n\n") if e.startswith("data: {")]
    assert all(e["usage"] is not None for e in events[kind == "chat" :])
