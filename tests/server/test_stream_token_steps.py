"""Every step that produced tokens is a streamed chunk, also when their text is empty or held back: a client's
time to first token and inter-token gaps then follow the engine, not the text."""

from __future__ import annotations

import asyncio
import json

from rnnserve.engine.sampling_params import SamplingParams
from rnnserve.engine.tokenizer import ByteTokenizer
from rnnserve.server.protocol import ChatCompletionRequest, CompletionRequest
from rnnserve.server.streaming import ChatStream, CompletionStream, Generation
from tests.server.test_stream_batching import QueuedSubmission, sent_writes, step_output

EOS = ByteTokenizer().eos_token_id
# A step per token: EOS (ignored, no text), the two bytes of "é" (the first held back), "x", then EOS again.
STEPS = [(EOS, ""), (0xC3, ""), (0xA9, "é"), (ord("x"), "x"), (EOS, "")]


def queued_steps() -> QueuedSubmission:
    return QueuedSubmission([step_output(text, t, i == len(STEPS) - 1) for i, (t, text) in enumerate(STEPS)])


def streamed_choices(stream: Generation) -> list[dict]:
    """The choices of every chunk the stream writes."""

    async def run() -> list[str]:
        return await sent_writes(stream)

    events = [e.removeprefix("data: ") for w in asyncio.run(run()) for e in w.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    return [json.loads(e)["choices"] for e in events[:-1]]


def test_completion_stream_sends_a_chunk_per_step_with_tokens() -> None:
    submission = queued_steps()
    params = SamplingParams(max_tokens=len(STEPS), ignore_eos=True)
    stream = CompletionStream(ByteTokenizer(), submission, CompletionRequest(prompt="p", stream=True), "m", params)
    choices = streamed_choices(stream)
    assert [c[0]["text"] for c in choices] == [text for _, text in STEPS]
    assert [c[0]["finish_reason"] for c in choices] == [None] * (len(STEPS) - 1) + ["length"]


def test_chat_stream_sends_a_chunk_per_step_with_tokens() -> None:
    submission = queued_steps()
    params = SamplingParams(max_tokens=len(STEPS), ignore_eos=True)
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "p"}], stream=True)
    choices = streamed_choices(ChatStream(ByteTokenizer(), submission, request, "m", params))
    assert choices[0][0]["delta"] == {"role": "assistant", "content": ""}  # the opening chunk, before any token
    assert [c[0]["delta"] for c in choices[1:]] == [{"content": text} for _, text in STEPS]


def test_echo_only_stream_sends_no_chunk_for_its_hidden_token() -> None:
    """``echo`` with ``max_tokens=0``: the one token the engine samples is not the client's, nor is its step."""
    submission = QueuedSubmission([step_output("x", ord("x"), True)])
    request = CompletionRequest(prompt="p", stream=True, echo=True, max_tokens=0)
    stream = CompletionStream(ByteTokenizer(), submission, request, "m", SamplingParams(max_tokens=1))

    async def run() -> list[str]:
        return await sent_writes(stream)

    events = [e for w in asyncio.run(run()) for e in w.split("\n\n") if e]
    [only, done] = events
    assert done == "data: [DONE]"
    assert json.loads(only.removeprefix("data: "))["choices"][0]["text"] == "p"  # the echo, with the finish
