"""Streamed outputs that queue up while the client is behind go out in one write, and nothing is lost."""

from __future__ import annotations

import asyncio
import json

from rnnserve.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from rnnserve.engine.sampling_params import SamplingParams
from rnnserve.engine.tokenizer import ByteTokenizer
from rnnserve.server.protocol import CompletionRequest
from rnnserve.server.streaming import CompletionStream


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
        return [w async for w in stream.events()]

    written = asyncio.run(writes())
    assert len(written) == 2  # every output was queued: one write for their chunks, one for [DONE]
    assert written[1] == "data: [DONE]\n\n"
    events = [e for e in written[0].split("\n\n") if e]
    texts = [json.loads(e.removeprefix("data: "))["choices"][0]["text"] for e in events]
    assert texts == deltas
