"""Turning a submission's engine outputs into OpenAI responses: streamed chunks (server-sent events) or one
JSON body, for completions and chat completions."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Awaitable
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from rnnserve.engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from rnnserve.engine.sampling_params import SamplingParams
from rnnserve.engine.tokenizer import ByteTokenizer, Tokenizer
from rnnserve.server.async_engine import EngineDeadError, RequestFailedError, Submission
from rnnserve.server.errors import APIError
from rnnserve.server.protocol import SamplingFields

logger = logging.getLogger("rnnserve.server")


def generation_error(err: Exception) -> APIError:
    """The API error for a generation that failed after it was accepted."""
    if isinstance(err, EngineDeadError):
        return APIError(503, str(err), type="service_unavailable")
    if not isinstance(err, RequestFailedError):
        logger.error("generation failed", exc_info=err)
    return APIError(500, f"generation failed: {err}", type="internal_error")


def sse_response(events: AsyncIterator[str], submission: Submission) -> StreamingResponse:
    """Stream server-sent events; whatever ends the stream (done, error, disconnect) aborts leftovers."""

    async def guarded() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield event
        finally:
            submission.abort()

    return StreamingResponse(
        guarded(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


async def until_disconnect(request: Request, work: Awaitable[dict], submission: Submission) -> dict:
    """Await a non-streaming result; if the client goes away first, abort the request (frees its slots)."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait([task, watcher], return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            task.cancel()
            raise APIError(499, "client disconnected", code="client_disconnected")
        try:
            return task.result()
        except Exception as err:
            raise generation_error(err) from err
    finally:
        watcher.cancel()
        submission.abort()


class Generation(ABC):
    """One (possibly multi-prompt) generation being turned into API responses."""

    id_prefix = ""
    object_name = ""
    chunk_object_name = ""

    def __init__(
        self, tokenizer: Tokenizer, submission: Submission, req: SamplingFields, model: str, params: SamplingParams
    ) -> None:
        self.tokenizer = tokenizer
        self.submission = submission
        self.req = req
        self.model = model
        self.params = params
        self.created = int(time.time())
        self.prompt_index = {rid: i for i, rid in enumerate(submission.request_ids)}
        self.prompt_tokens: dict[str, int] = {}
        self.completion_tokens: dict[tuple[str, int], int] = {}

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def token_bytes(self, token_id: int) -> list[int]:
        if isinstance(self.tokenizer, ByteTokenizer) and token_id < 256:
            return [token_id]
        return list(self.token_text(token_id).encode())

    def choice_index(self, out: RequestOutput, sample: CompletionOutput) -> int:
        return self.prompt_index[out.request_id] * self.params.n + sample.index

    def record(self, out: RequestOutput) -> None:
        self.prompt_tokens[out.request_id] = len(out.prompt_token_ids)
        for sample in out.outputs:
            self.completion_tokens[(out.request_id, sample.index)] = len(sample.token_ids)

    def usage(self) -> dict[str, int]:
        prompt, completion = sum(self.prompt_tokens.values()), sum(self.completion_tokens.values())
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def body(self, object_name: str, choices: list[dict]) -> dict[str, Any]:
        return {
            "id": self.submission.request_id,
            "object": object_name,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def chunk(self, choices: list[dict], usage: dict | None = None) -> str:
        body = self.body(self.chunk_object_name, choices)
        if self.req.include_usage:
            options = self.req.stream_options
            body["usage"] = self.usage() if usage is None and options and options.continuous_usage_stats else usage
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    async def events(self) -> AsyncIterator[str]:
        """SSE events: chunks, an optional usage chunk, ``[DONE]``; an error event if generation fails."""
        try:
            async for out in self.submission.outputs():
                self.record(out)
                choices = [c for sample in out.outputs if (c := self.stream_choice(out, sample)) is not None]
                if choices:
                    yield self.chunk(choices)
            if self.req.include_usage:
                yield self.chunk([], self.usage())
        except Exception as err:  # a failed generation ends with an error event, never a hung stream
            yield generation_error(err).sse()
        yield "data: [DONE]\n\n"

    async def collect(self) -> dict:
        """The whole (non-streamed) response body."""
        final: dict[str, RequestOutput] = {}
        async for out in self.submission.outputs():
            self.record(out)
            if out.finished:
                final[out.request_id] = out
        choices = [self.final_choice(out, sample) for out in final.values() for sample in out.outputs]
        return {**self.body(self.object_name, sorted(choices, key=lambda c: c["index"])), "usage": self.usage()}

    @abstractmethod
    def stream_choice(self, out: RequestOutput, sample: CompletionOutput) -> dict | None:
        """The streamed choice for one sample's progress this step, or None when there is nothing to send."""

    @abstractmethod
    def final_choice(self, out: RequestOutput, sample: CompletionOutput) -> dict:
        """One choice of the non-streamed response."""


class CompletionStream(Generation):
    id_prefix = "cmpl"
    object_name = "text_completion"
    chunk_object_name = "text_completion"

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.offsets: dict[int, int] = {}
        self.echoed: set[int] = set()

    def prompt_text(self, out: RequestOutput) -> str:
        return out.prompt if out.prompt is not None else self.tokenizer.decode(out.prompt_token_ids)

    def logprobs(self, index: int, entries: list[TokenLogprob]) -> dict | None:
        if self.params.logprobs is None:
            return None
        tokens = [self.token_text(e.token_id) for e in entries]
        offsets = []
        offset = self.offsets.get(index, 0)
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        self.offsets[index] = offset
        return {
            "tokens": tokens,
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{self.token_text(t): lp for t, lp in e.top} for e in entries],
            "text_offset": offsets,
        }

    def stream_choice(self, out: RequestOutput, sample: CompletionOutput) -> dict | None:
        index = self.choice_index(out, sample)
        text = sample.text_delta
        if self.req.echo and index not in self.echoed:
            self.echoed.add(index)
            text = self.prompt_text(out) + text
        wants_logprobs = self.params.logprobs is not None and sample.new_logprobs
        if not text and not sample.finished and not wants_logprobs:
            return None
        return {
            "index": index,
            "text": text,
            "finish_reason": sample.finish_reason,
            "logprobs": self.logprobs(index, sample.new_logprobs),
        }

    def final_choice(self, out: RequestOutput, sample: CompletionOutput) -> dict:
        index = self.choice_index(out, sample)
        return {
            "index": index,
            "text": (self.prompt_text(out) if self.req.echo else "") + sample.text,
            "finish_reason": sample.finish_reason,
            "logprobs": self.logprobs(index, sample.logprobs or []),
        }


class ChatStream(Generation):
    id_prefix = "chatcmpl"
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.started: set[int] = set()

    def logprobs(self, entries: list[TokenLogprob]) -> dict | None:
        if self.params.logprobs is None:
            return None

        def item(token_id: int, logprob: float) -> dict:
            return {"token": self.token_text(token_id), "logprob": logprob, "bytes": self.token_bytes(token_id)}

        content = [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]} for e in entries]
        return {"content": content, "refusal": None}

    def stream_choice(self, out: RequestOutput, sample: CompletionOutput) -> dict | None:
        index = self.choice_index(out, sample)
        delta: dict[str, str] = {}
        if index not in self.started:
            self.started.add(index)
            delta["role"] = "assistant"
        if sample.text_delta or "role" in delta:
            delta["content"] = sample.text_delta
        wants_logprobs = self.params.logprobs is not None and sample.new_logprobs
        if not delta and not sample.finished and not wants_logprobs:
            return None
        return {
            "index": index,
            "delta": delta,
            "finish_reason": sample.finish_reason,
            "logprobs": self.logprobs(sample.new_logprobs),
        }

    def final_choice(self, out: RequestOutput, sample: CompletionOutput) -> dict:
        return {
            "index": sample.index,
            "message": {"role": "assistant", "content": sample.text},
            "finish_reason": sample.finish_reason,
            "logprobs": self.logprobs(sample.logprobs or []),
        }
