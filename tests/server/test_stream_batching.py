"""Streamed outputs that queue up while the client is behind go out in one write, and nothing is lost."""

from __future__ import annotations

import asyncio
import json

from rnnserve.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from rnnserve.engine.sampling_params import SamplingParams
from rnnserve.engine.tokenizer import ByteTokenizer
from rnnserve.server.protocol import CompletionRequest
from rnnserve.server.streaming import CompletionStream, Generation


class QueuedSubmission:
    """The part of a Submission that a stream reads: a queue of outputs for one request."""

    def __init__(self, outputs: list[RequestOutput]) -> None:
        self.request_id = "cmpl-test"
        self.request_ids = ["r0"]
        self.queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self.ended = False
        for out in outputs:
            self.queue.put_nowait(out)

    def has_queued(self) -> bool:
        return not self.queue.empty()

    async def next_output(self) -> RequestOutput | None:
        if self.ended:
            return None
        out = await self.queue.get()
        self.ended = out.finished
        return out


async def sent_writes(stream: Generation) -> list[str]:
    """The body of each message the stream sends (``Generation.send_events``), in order; the last ends the body."""
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    await stream.send_events(send)
    assert [m["more_body"] for m in sent] == [True] * (len(sent) - 1) + [False]
    return [m["body"].decode() for m in sent]


def step_output(text: str, step: int, last: bool) -> RequestOutput:
    sample = CompletionOutput(
        index=0,
        text="",
        token_ids=[],
        finish_reason="length" if last else None,
        logprobs=None,
        cumulative_logprob=0.0,
        text_delta=text,
        new_token_ids=[step],
    )
    return RequestOutput("r0", "p", [1], [sample], last, RequestMetrics(0.0))


def test_queued_outputs_are_written_together_and_in_order() -> None:
    deltas = ["a", "b", "c", "d"]
    outputs = [step_output(d, i, i == len(deltas) - 1) for i, d in enumerate(deltas)]
    params = SamplingParams(max_tokens=4)
    stream = CompletionStream(
        ByteTokenizer(), QueuedSubmission(outputs), CompletionRequest(prompt="p", stream=True), "m", params
    )

    async def writes() -> list[str]:
        return await sent_writes(stream)

    written = asyncio.run(writes())
    assert len(written) == 2  # every output was queued: one write for their chunks, one for [DONE]
    assert written[1] == "data: [DONE]\n\n"
    events = [e for e in written[0].split("\n\n") if e]
    texts = [json.loads(e.removeprefix("data: "))["choices"][0]["text"] for e in events]
    assert texts == deltas


def sample_output(index: int, text: str, token: int, finish_reason: str | None) -> CompletionOutput:
    return CompletionOutput(index, "", [], finish_reason, None, 0.0, text_delta=text, new_token_ids=[token])


def test_a_choice_that_ended_is_not_streamed_again_while_its_sibling_goes_on() -> None:
    """Each output of a request carries all its samples, also one that ended steps before the others: its end is
    streamed once, and nothing of it follows (as in OpenAI's and vLLM's streams). Scripted, so that the steps are
    not merged as a loaded machine's consumer may merge them."""
    steps = [
        [sample_output(0, "a", 1, None), sample_output(1, "b", 2, None)],
        [sample_output(0, "c", 3, "stop"), sample_output(1, "d", 4, None)],
        [sample_output(0, "", 0, "stop"), sample_output(1, "e", 5, None)],
        [sample_output(0, "", 0, "stop"), sample_output(1, "f", 6, "length")],
    ]
    outputs = [RequestOutput("r0", "p", [1], samples, i == len(steps) - 1, RequestMetrics(0.0))
               for i, samples in enumerate(steps)]  # fmt: skip
    params = SamplingParams(n=2, max_tokens=3)
    request = CompletionRequest(prompt="p", stream=True, n=2)
    stream = CompletionStream(ByteTokenizer(), QueuedSubmission(outputs), request, "m", params)

    async def writes() -> list[str]:
        return await sent_writes(stream)

    events = [e for w in asyncio.run(writes()) for e in w.split("\n\n") if e and e != "data: [DONE]"]
    choices = [c for e in events for c in json.loads(e.removeprefix("data: "))["choices"]]
    assert [(c["index"], c["text"], c["finish_reason"]) for c in choices] == [
        (0, "a", None), (1, "b", None), (0, "c", "stop"), (1, "d", None), (1, "e", None), (1, "f", "length"),
    ]  # fmt: skip
