"""Turning a submission's engine outputs into OpenAI responses: streamed chunks (server-sent events) or one
JSON body, for completions and chat completions.

Prompt logprobs appear in two shapes: OpenAI's ``echo`` with ``logprobs`` (the completion's ``logprobs`` lists
start with the prompt's tokens, the first with ``null``) and vLLM's ``prompt_logprobs`` (per prompt token
``null`` or ``{token_id: {logprob, rank, decoded_token}}``; on the choice for completions, on the response
for chat, in the first chunk of each choice when streaming completions).
"""

from __future__ import annotations

import asyncio
import codecs
import json
import logging
import random
import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Coroutine
from typing import Any, TypeVar

from fastapi import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from rnnserve.engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from rnnserve.engine.sampling_params import InvalidParameterError, SamplingParams
from rnnserve.engine.tokenizer import Tokenizer
from rnnserve.server.async_engine import EngineDeadError, RequestFailedError, Submission
from rnnserve.server.errors import APIError, bad_request
from rnnserve.server.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields

logger = logging.getLogger("rnnserve.server")


def generation_error(err: Exception) -> APIError:
    """The API error for a generation that failed after it was accepted (an APIError as it is, e.g. a
    session's state that could not be stored; a 400 naming the parameter whose fault it was)."""
    if isinstance(err, APIError):
        return err
    if isinstance(err, InvalidParameterError):
        return bad_request(str(err), param=err.param)
    if isinstance(err, EngineDeadError):
        return APIError(503, str(err), type="service_unavailable", retryable=True)
    if not isinstance(err, RequestFailedError):
        logger.error("generation failed", exc_info=err)
    # retryable: a failed engine step fails every request in it, whichever of them (or none: an out-of-memory
    # error) caused it
    return APIError(500, f"generation failed: {err}", type="internal_error", retryable=True)


# Characters some line readers treat as line ends (Python's str.splitlines, JavaScript's old JSON.parse): written
# as JSON escapes so a streamed event stays on one line for every client.
_LINE_BREAK_ESCAPES = str.maketrans({"\u2028": "\\u2028", "\u2029": "\\u2029", "\x85": "\\u0085"})
# One encoder for every event: json.dumps with any option builds a new encoder per call, which cost more than
# the encoding of a streamed chunk's choices.
_JSON = json.JSONEncoder(ensure_ascii=False)
_encode_string = json.encoder.encode_basestring  # a str as a JSON string, non-ASCII kept (ensure_ascii=False)


def json_text(value: Any) -> str:
    """``value`` as JSON for an SSE event: UTF-8 text as is, but no character a client could split on."""
    return _escape_line_breaks(_JSON.encode(value))


def json_string(value: str | None) -> str:
    """``json_text`` of a string or ``None``, without the encoder (whose setup costs ~2 us a call)."""
    return "null" if value is None else _escape_line_breaks(_encode_string(value))


# The logprob JSON gets for a token the request's constraint rules out (-inf in the engine), as vLLM and OpenAI
# write it: JSON has no infinity, and strict parsers reject the `-Infinity` Python would write.
MIN_JSON_LOGPROB = -9999.0


def json_logprob(logprob: float) -> float:
    """``logprob`` for a JSON body: at least :data:`MIN_JSON_LOGPROB` (also for NaN)."""
    return logprob if logprob > MIN_JSON_LOGPROB else MIN_JSON_LOGPROB


def _escape_line_breaks(text: str) -> str:
    if "\u2028" in text or "\u2029" in text or "\x85" in text:  # rare; a translate scans every character
        return text.translate(_LINE_BREAK_ESCAPES)
    return text


# The keys of the usual streamed choice of each kind: choices_json writes those directly (in the order they are built)
COMPLETION_CHOICE_KEYS = {"index", "text", "finish_reason", "logprobs"}
CHAT_CHOICE_KEYS = {"index", "delta", "finish_reason", "logprobs"}

SSE_HEADERS = ((b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no"),
               (b"content-type", b"text/event-stream; charset=utf-8"))  # fmt: skip


DONE_EVENT = "data: [DONE]\n\n"
# Where the app puts the server's own ``send`` in a request's scope (``ServerApp``): a stream's body messages go
# to it directly, past the send wrappers of the app's middleware.
SERVER_SEND = "rnnserve.server_send"


class EventStreamResponse(Response):
    """Server-sent events, one body message per write of ``stream`` (:meth:`Generation.send_events`); whatever
    ends the stream (done, error, disconnect) aborts the submission's leftovers.

    A task of its own waits for the client's disconnect and fails the submission (:func:`fail_on_disconnect`),
    whose events then end at once. (Starlette's ``StreamingResponse`` runs each response in an anyio task group
    with a second task and cancel scopes under ASGI < 2.4, as uvicorn speaks it: about 40% of the serving
    process's CPU for a one-token stream in ``benchmarks/server_overhead.py``.) The events are sent from a task of
    their own too: a token's output wakes that task, whose coroutines are this response's few, where the request's
    task would resume (and suspend again) every middleware of the app on each token. The response's start goes
    through the app's ``send`` (Starlette's middlewares wrap it to see whether a response started); its body goes
    to the server's own ``send`` where the app left it in the scope (:data:`SERVER_SEND`): the wrappers, three
    coroutines that look at each message's type, would run on every token. No middleware of the app may so
    rewrite a streamed body (none does: they look at a response's start only)."""

    def __init__(self, stream: Generation) -> None:
        self.stream = stream
        self.submission = stream.submission
        self.status_code = 200
        self.background = None
        self.raw_headers = list(SSE_HEADERS)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        loop = asyncio.get_running_loop()
        watcher = loop.create_task(fail_on_disconnect(receive, self.submission))
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            body_send = scope.get(SERVER_SEND, send)
            await loop.create_task(self.stream.send_events(body_send))  # cancelled with this task (a drain's end)
        except OSError:  # ASGI 2.4: a send to a closed connection raises
            pass
        except asyncio.CancelledError:  # the end of a drain cancels a stream whose client stopped reading: not
            logger.info("a stream's client stopped reading; it was cancelled")  # a crash, as a traceback said
        finally:
            watcher.cancel()
            self.submission.abort()


T = TypeVar("T")


async def wait_for_disconnect(receive: Receive) -> None:
    """Return once the client disconnected (a ``receive`` that raises means the connection is gone all the same)."""
    try:
        while (await receive())["type"] != "http.disconnect":
            pass
    except Exception:  # noqa: BLE001 - whatever broke the connection, the client cannot read the answer
        logger.debug("receive failed while waiting for a disconnect", exc_info=True)


def client_disconnected() -> APIError:
    return APIError(499, "client disconnected", code="client_disconnected")


async def fail_on_disconnect(receive: Receive, submission: Submission) -> None:
    """Wait for the client's disconnect, then fail ``submission`` with a 499 (its outputs end with it at once)."""
    await wait_for_disconnect(receive)
    submission.fail(client_disconnected())


async def unless_disconnected(receive: Receive, work: Coroutine[Any, Any, T]) -> T:
    """What ``work`` returns, or a 499 once the client disconnects first, ``work`` then cancelled: a request whose
    structured output waits to compile (seconds, behind others) gives its place up at once, instead of being
    compiled and run for nobody."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(receive))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            task.cancel()
            await asyncio.wait((task,))
    finally:
        watcher.cancel()
        task.cancel()  # a no-op once it is done; else this coroutine was cancelled, and the work goes with it
    if task.cancelled():
        raise client_disconnected()
    return task.result()


async def until_disconnect(request: Request, work: Awaitable[dict], submission: Submission) -> dict:
    """Await a non-streaming result; if the client goes away first, abort the request (frees its slots)."""
    watcher = asyncio.get_running_loop().create_task(fail_on_disconnect(request.receive, submission))
    try:
        return await work
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
        self.include_usage = req.include_usage  # read on every chunk: once here, not through the request model
        self.continuous_usage = req.continuous_usage
        self.model = model
        self.params = params
        self.created = int(time.time())
        self.prompt_index = {rid: i for i, rid in enumerate(submission.request_ids)}
        self.prompt_tokens: dict[str, int] = {}
        self.cached_tokens: dict[str, int] = {}
        self.completion_tokens: dict[tuple[str, int], int] = {}
        self.ended: set[int] = set()  # the choices whose finish_reason was streamed
        # Every chunk's body without its end: '{"id": ..., "model": ..., "choices": []}' less the final '[]}'.
        self._chunk_head = "data: " + json_text(self.body(self.chunk_object_name, []))[:-3]
        # A plain chunk's text before and after its JSON-escaped delta, once the stream's chunks are plain (see
        # plain_chunk_parts); None until then.
        self.plain_parts: tuple[str, str] | None = None

    def token_text(self, token_id: int) -> str:
        """A token's string in logprobs: its text, or a special token's own (``<|im_end|>``, as vLLM gives it:
        left out of the text, it still tells the client which special token came, and keys its alternatives)."""
        special = self.tokenizer.special_text(token_id)
        return special if special is not None else self.tokenizer.decode([token_id])

    def token_bytes(self, token_id: int) -> list[int]:
        return list(self.piece_bytes(token_id))

    def piece_bytes(self, token_id: int, special_text: bool = True) -> bytes:
        """The token's bytes; a special token's own text's where ``special_text`` (else none)."""
        special = self.tokenizer.special_text(token_id) if special_text else None
        return special.encode() if special is not None else self.tokenizer.token_bytes(token_id)

    def choice_index(self, out: RequestOutput, sample: CompletionOutput) -> int:
        return self.prompt_index[out.request_id] * self.params.n + sample.index

    def record_prompt(self, out: RequestOutput) -> None:
        """Count the prompt tokens of ``out``'s request in the usage."""
        self.prompt_tokens[out.request_id] = len(out.prompt_token_ids)
        self.cached_tokens[out.request_id] = out.num_cached_tokens

    def record(self, out: RequestOutput) -> None:
        """Count ``out``'s prompt and generated tokens in the usage."""
        self.record_prompt(out)
        for sample in out.outputs:
            self.completion_tokens[(out.request_id, sample.index)] = self.reported_tokens(sample)

    def reported_tokens(self, sample: CompletionOutput) -> int:
        """How many of the sample's tokens the response reports as completion tokens."""
        return sample.num_tokens

    def prompt_logprobs(self, out: RequestOutput) -> list[dict | None]:
        """vLLM's ``prompt_logprobs``: per prompt token ``None`` (the first) or the token's logprob and rank
        followed by the top ``prompt_logprobs`` alternatives, keyed by token id."""
        top_n = self.req.prompt_logprobs or 0
        result: list[dict | None] = []
        for entry in out.prompt_logprobs or []:
            if entry is None:
                result.append(None)
                continue
            ranked = {str(entry.token_id): self.ranked(entry.token_id, entry.logprob, entry.rank)}
            for rank, (token_id, logprob) in enumerate(entry.top[:top_n], start=1):
                ranked.setdefault(str(token_id), self.ranked(token_id, logprob, rank))
            result.append(ranked)
        return result

    def ranked(self, token_id: int, logprob: float, rank: int | None) -> dict[str, Any]:
        return {"logprob": json_logprob(logprob), "rank": rank, "decoded_token": self.token_text(token_id)}

    def usage(self) -> dict[str, Any]:
        """OpenAI's usage; ``prompt_tokens`` counts the whole sequence before the output (a session's history
        included), ``prompt_tokens_details.cached_tokens`` those of it that were not prefilled."""
        prompt, completion = sum(self.prompt_tokens.values()), sum(self.completion_tokens.values())
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(self.cached_tokens.values())},
        }

    def body(self, object_name: str, choices: list[dict]) -> dict[str, Any]:
        return {
            "id": self.submission.request_id,
            "object": object_name,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def chunk(self, choices: list[dict], usage: dict | None = None) -> str:
        """One streamed chunk, ``data: <body as json_text>``, the body with ``choices`` (and ``usage`` when asked
        for); the fields every chunk shares are rendered once per response (a stream renders hundreds)."""
        if not self.include_usage:
            return f"{self._chunk_head}{self.choices_json(choices)}}}\n\n"
        usage = self.usage() if usage is None and self.continuous_usage else usage
        usage_text = "null" if usage is None else json_text(usage)
        return f'{self._chunk_head}{self.choices_json(choices)}, "usage": {usage_text}}}\n\n'

    def choices_json(self, choices: list[dict]) -> str:
        """A chunk's choices as JSON (``json_text``; subclasses write their usual one-choice chunk directly)."""
        return json_text(choices)

    def plain_chunk_parts(self, choice_start: str, choice_end: str) -> tuple[str, str] | None:
        """What a plain chunk holds around its delta's JSON string: one choice (index 0) whose delta is text, no
        finish_reason, no logprobs, ``usage`` null where it is included. ``choice_start`` and ``choice_end``:
        the choice's JSON before and after that string. ``None`` for a stream whose chunks may be other than
        plain before they end (several choices or prompts, logprobs, usage on every chunk)."""
        if self.params.n != 1 or len(self.submission.request_ids) != 1 or self.params.logprobs is not None:
            return None
        if self.continuous_usage:
            return None
        usage = ', "usage": null' if self.include_usage else ""
        return f"{self._chunk_head}[{choice_start}", f"{choice_end}]{usage}}}\n\n"

    async def send_events(self, send: Send) -> None:
        """Send the SSE events as ASGI body messages: chunks, an optional usage chunk, ``[DONE]`` (in the message
        that ends the body); an error event before it if generation fails. A ``send`` that raises (a closed
        connection) raises here: there is nobody to tell.

        The chunks of outputs that are already queued go out in one write: a client (or an event loop) that
        falls behind the engine catches up with one send per batch, not one per token. Once the stream's chunks
        are plain (:attr:`plain_parts`), an output that adds text or tokens and does not finish is written from
        those parts and its delta alone, without choice dicts (as :meth:`chunk` would write it). A coroutine that
        sends, not an async generator of events: each token's resumption then passes through one frame less."""
        pending: list[str] = []
        sending = False  # what raises while this is set is the send's, not the generation's
        try:
            continuous_usage = self.continuous_usage
            # With running usage the opening chunks wait for the first output, which tells the prompt's length
            # (as vLLM sends them): before it, their usage would say 0 prompt tokens.
            opening = self.opening_choices()
            if not continuous_usage:
                for choice in opening:
                    sending = True
                    await send({"type": "http.response.body", "body": self.chunk([choice]).encode(), "more_body": True})
                    sending = False
                opening = []
            next_output = self.submission.next_output
            has_queued = self.submission.has_queued
            while (out := await next_output()) is not None:
                if opening:
                    self.record_prompt(out)
                    pending += [self.chunk([choice]) for choice in opening]
                    opening = []
                if (parts := self.plain_parts) is not None and not out.finished:
                    sample = out.outputs[0]
                    if sample.text_delta or sample.new_token_ids:
                        pending.append(f"{parts[0]}{json_string(sample.text_delta)}{parts[1]}")
                elif out.finished or continuous_usage:  # usage counts each request's last output
                    self.record(out)
                if parts is None or out.finished:
                    choices = [c for sample in out.outputs if (c := self.next_choice(out, sample)) is not None]
                    if choices:
                        pending.append(self.chunk(choices))
                    if closing := self.closing_choices():
                        pending.append(self.chunk(closing))
                if pending and not has_queued():
                    body = "".join(pending).encode()
                    pending.clear()
                    sending = True
                    await send({"type": "http.response.body", "body": body, "more_body": True})
                    sending = False
            if self.include_usage:
                pending.append(self.chunk([], self.usage()))
        except Exception as err:  # a failed generation ends with an error event, never a hung stream
            if sending:
                raise
            pending.append(generation_error(err).sse())
        pending.append(DONE_EVENT)
        await send({"type": "http.response.body", "body": "".join(pending).encode(), "more_body": False})

    async def collect(self) -> dict:
        """The whole (non-streamed) response body."""
        final: dict[str, RequestOutput] = {}
        async for out in self.submission.outputs():
            self.record(out)
            if out.finished:
                final[out.request_id] = out
        choices = [self.final_choice(out, sample) for out in final.values() for sample in out.outputs]
        body = self.body(self.object_name, sorted(choices, key=lambda c: c["index"]))
        return {**body, **self.response_fields(list(final.values())), "usage": self.usage()}

    def next_choice(self, out: RequestOutput, sample: CompletionOutput) -> dict | None:
        """``stream_choice`` of a sample that has not ended; ``None`` for one whose end was streamed already (a
        request's outputs carry all its samples, also those that ended steps before its others)."""
        if sample.finished:
            index = self.choice_index(out, sample)
            if index in self.ended:
                return None
            self.ended.add(index)
        return self.stream_choice(out, sample)

    def opening_choices(self) -> list[dict]:
        """Choices streamed before any output, one chunk each."""
        return []

    def closing_choices(self) -> list[dict]:
        """Choices to send in a chunk of their own after this step's (taken once)."""
        return []

    def response_fields(self, finals: list[RequestOutput]) -> dict[str, Any]:
        """Extra top-level fields of the non-streamed response."""
        return {}

    @abstractmethod
    def stream_choice(self, out: RequestOutput, sample: CompletionOutput) -> dict | None:
        """The streamed choice for one sample's progress this step, or None when there is nothing to send. A
        step that produced tokens sends a choice even when their text is held back (a character split across
        tokens) or empty (special tokens): as vLLM does, a client then sees every step that advanced its
        stream, so the time to first token and the gaps between tokens it measures are the engine's."""

    @abstractmethod
    def final_choice(self, out: RequestOutput, sample: CompletionOutput) -> dict:
        """One choice of the non-streamed response."""


class CompletionStream(Generation):
    id_prefix = "cmpl"
    object_name = "text_completion"
    chunk_object_name = "text_completion"
    req: CompletionRequest

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.offsets: dict[int, tuple[int, codecs.IncrementalDecoder]] = {}  # characters so far, their decoder
        self.started: set[int] = set()
        self.echo_only = self.req.echo_only

    def prompt_text(self, out: RequestOutput) -> str:
        if out.prompt is not None:
            return out.prompt
        return self.tokenizer.decode_with_specials(out.prompt_token_ids)

    def reported_tokens(self, sample: CompletionOutput) -> int:
        return 0 if self.echo_only else sample.num_tokens

    def echoed_offsets(self, out: RequestOutput) -> tuple[str, list[int]] | None:
        """The echoed prompt's text and where each of its tokens starts in it, from the tokenizer's own alignment
        of the text (a Metaspace tokenizer's ``▁`` before the first word, special tokens typed in the prompt:
        counting the tokens' bytes put every offset after them too far), else from the tokens' bytes, decoded
        on their own as the echoed text is (a prompt that ends inside a character ends with its replacement
        character, and the generated tokens start after it). ``None`` without ``echo`` and ``logprobs``."""
        if not self.req.echo or self.params.logprobs is None:
            return None
        text = self.prompt_text(out)
        starts = self.tokenizer.char_offsets(text, out.prompt_token_ids)
        if starts is None:
            utf8 = codecs.getincrementaldecoder("utf-8")("replace")
            offset, starts = 0, []
            for token_id in out.prompt_token_ids:
                starts.append(min(offset, len(text)))
                offset += len(utf8.decode(self.piece_bytes(token_id)))
        return text, starts

    def echoed_entries(self, out: RequestOutput) -> list[tuple[int, TokenLogprob | None]]:
        """The prompt's tokens and logprobs that ``echo`` with ``logprobs`` puts before the generated ones."""
        if not self.req.echo or self.params.logprobs is None:
            return []
        return list(zip(out.prompt_token_ids, out.prompt_logprobs or [], strict=True))

    def generated_entries(self, entries: list[TokenLogprob]) -> list[tuple[int, TokenLogprob | None]]:
        return [] if self.echo_only else [(e.token_id, e) for e in entries]

    def logprobs(
        self, index: int, entries: list[tuple[int, TokenLogprob | None]], echoed: tuple[str, list[int]] | None = None
    ) -> dict | None:
        """OpenAI's completion logprobs; prompt tokens echoed with them may have no entry (the first).
        ``echoed``: the echoed prompt's text and its tokens' offsets in it, for the first entries."""
        if self.params.logprobs is None:
            return None
        top_n = self.params.logprobs
        tokens = [self.token_text(token_id) for token_id, _ in entries]
        # A token's offset is the character of the text where its bytes start: the bytes of one character split
        # across tokens (a byte-level vocabulary) share its offset.
        offset, utf8 = self.offsets.get(index) or (0, codecs.getincrementaldecoder("utf-8")("replace"))
        offsets: list[int] = []
        if echoed is not None:
            offsets, offset = list(echoed[1]), len(echoed[0])
        kept = not self.params.skip_special_tokens  # special tokens' text is in the generated text then
        for token_id, _ in entries[len(offsets) :]:
            offsets.append(offset)
            offset += len(utf8.decode(self.piece_bytes(token_id, kept)))
        self.offsets[index] = (offset, utf8)
        return {
            "tokens": tokens,
            "token_logprobs": [json_logprob(e.logprob) if e is not None else None for _, e in entries],
            "top_logprobs": [self.top_by_text(e.top[:top_n], e) if e is not None else None for _, e in entries],
            "text_offset": offsets,
        }

    def top_by_text(self, top: list[tuple[int, float]], chosen: TokenLogprob) -> dict[str, float]:
        """Alternatives keyed by their text, and the chosen token after them where it is not among them (OpenAI:
        up to ``logprobs + 1`` entries, as vLLM gives them); of tokens with the same text (e.g. ids without text)
        the most likely one is kept, so the first value is still the largest."""
        by_text: dict[str, float] = {}
        for token_id, logprob in top:
            by_text.setdefault(self.token_text(token_id), json_logprob(logprob))
        by_text.setdefault(self.token_text(chosen.token_id), json_logprob(chosen.logprob))
        return by_text

    def choices_json(self, choices: list[dict]) -> str:
        """The usual chunk, one choice without logprobs (``choice``'s four keys), written directly."""
        if len(choices) == 1 and (choice := choices[0]).keys() == COMPLETION_CHOICE_KEYS and choice["logprobs"] is None:
            return (f'[{{"index": {choice["index"]:d}, "text": {json_string(choice["text"])}, '
                    f'"finish_reason": {json_string(choice["finish_reason"])}, "logprobs": null}}]')  # fmt: skip
        return json_text(choices)

    def choice(
        self, out: RequestOutput, index: int, text: str, sample: CompletionOutput, logprobs: dict | None, first: bool
    ) -> dict:
        """A choice; the first of each index carries ``prompt_logprobs`` when they were asked for."""
        finish = "length" if self.echo_only and sample.finished else sample.finish_reason
        choice = {"index": index, "text": text, "finish_reason": finish, "logprobs": logprobs}
        if finish is not None:
            choice["stop_reason"] = sample.stop_reason
        if first and self.req.prompt_logprobs is not None:
            choice["prompt_logprobs"] = self.prompt_logprobs(out)
        return choice

    def stream_choice(self, out: RequestOutput, sample: CompletionOutput) -> dict | None:
        index = self.choice_index(out, sample)
        text = "" if self.echo_only else sample.text_delta
        entries = self.generated_entries(sample.new_logprobs) if self.params.logprobs is not None else []
        first = index not in self.started
        echoed = None
        if first:
            self.started.add(index)
            if self.req.echo:
                text = self.prompt_text(out) + text
                entries = self.echoed_entries(out) + entries
                echoed = self.echoed_offsets(out)
            else:
                self.plain_parts = self.plain_chunk_parts('{"index": 0, "text": ', ', "finish_reason": null, '
                                                          '"logprobs": null}')  # fmt: skip
        wants_logprobs = self.params.logprobs is not None and entries
        new_tokens = bool(sample.new_token_ids) and not self.echo_only
        opening_logprobs = first and self.req.prompt_logprobs is not None
        news = text or new_tokens or sample.finished or wants_logprobs or opening_logprobs
        return self.choice(out, index, text, sample, self.logprobs(index, entries, echoed), first) if news else None

    def final_choice(self, out: RequestOutput, sample: CompletionOutput) -> dict:
        index = self.choice_index(out, sample)
        text = "" if self.echo_only else sample.text
        entries = self.generated_entries(sample.logprobs or [])
        echoed = None
        if self.req.echo:
            text = self.prompt_text(out) + text
            entries = self.echoed_entries(out) + entries
            echoed = self.echoed_offsets(out)
        return self.choice(out, index, text, sample, self.logprobs(index, entries, echoed), first=True)


def required_calls(text: str) -> list[tuple[str, str]] | None:
    """``(name, arguments)`` of each call in a ``required`` answer (``[{"name": ..., "parameters": {...}}, ...]``),
    the arguments exactly as generated: parsed and written again, a number beyond a float's range became
    ``Infinity`` (not JSON), long decimals were rounded and repeated keys dropped. ``None`` unless ``text`` is such
    a list, complete."""
    decoder = json.JSONDecoder()

    def skip(i: int) -> int:
        while i < len(text) and text[i] in " \t\n\r":
            i += 1
        return i

    calls: list[tuple[str, str]] = []
    try:
        i = skip(0)
        if text[i] != "[":
            return None
        i = skip(i + 1)
        while text[i] != "]":
            if text[i] != "{":
                return None
            fields: dict[str, Any] = {}
            i = skip(i + 1)
            while text[i] != "}":
                key, i = decoder.raw_decode(text, i)
                i = skip(i)
                if text[i] != ":":
                    return None
                start = skip(i + 1)
                value, i = decoder.raw_decode(text, start)
                fields[key] = text[start:i] if key == "parameters" else value
                i = skip(i)
                i = skip(i + 1) if text[i] == "," else i
            if not isinstance(fields.get("name"), str) or "parameters" not in fields:
                return None
            calls.append((fields["name"], fields["parameters"]))
            i = skip(i + 1)
            i = skip(i + 1) if text[i] == "," else i
        return calls if skip(i + 1) == len(text) else None
    except (IndexError, ValueError):
        return None


def tool_call_id() -> str:
    return f"call_{random.getrandbits(96):024x}"


class ChatStream(Generation):
    """Chat answers: the message's content, or, when ``tool_choice`` forces calls, its ``tool_calls``. A named
    function's arguments are the sample's text and stream as they are generated; ``required`` calls (the text
    a JSON list of ``{"name", "parameters"}``) are sent whole with the sample's end, ``finish_reason``
    ``tool_calls``. A named call cut by ``max_tokens`` has incomplete arguments (``finish_reason`` ``length``, as
    OpenAI's); ``required`` calls cut so keep their text as content."""

    id_prefix = "chatcmpl"
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"
    req: ChatCompletionRequest

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.tool_mode = self.req.tool_mode
        self.tool_name = self.req.named_tool().function.name if self.tool_mode == "named" else None
        self.call_ids: dict[int, str] = {}  # a named call's id per choice, from its first chunk on
        self.call_texts: dict[int, list[str]] = {}  # a stream's ``required`` calls so far, per choice
        self.finishing: list[dict] = []  # finish_reasons held back from a chunk that carries tool calls
        if self.tool_mode is None:
            self.plain_parts = self.plain_chunk_parts('{"index": 0, "delta": {"content": ',
                                                      '}, "finish_reason": null, "logprobs": null}')  # fmt: skip

    def tool_calls(self, text: str) -> list[dict[str, Any]] | None:
        """The calls a finished sample's ``text`` makes, or ``None`` when it is not a complete list of calls."""
        if self.tool_mode == "named":
            return [self.call(tool_call_id(), self.tool_name, text)]  # type: ignore[arg-type]
        calls = required_calls(text)
        return None if calls is None else [self.call(tool_call_id(), name, arguments) for name, arguments in calls]

    @staticmethod
    def call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
        return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}

    def choices_json(self, choices: list[dict]) -> str:
        """The usual chunk, one choice without logprobs whose delta is content or nothing (``stream_choice``'s
        shape), written directly."""
        if len(choices) == 1 and (choice := choices[0]).keys() == CHAT_CHOICE_KEYS and choice["logprobs"] is None:
            delta = choice["delta"]
            if not delta:
                delta_text = "{}"
            elif len(delta) == 1 and "content" in delta:
                delta_text = f'{{"content": {json_string(delta["content"])}}}'
            else:
                return json_text(choices)
            return (f'[{{"index": {choice["index"]:d}, "delta": {delta_text}, '
                    f'"finish_reason": {json_string(choice["finish_reason"])}, "logprobs": null}}]')  # fmt: skip
        return json_text(choices)

    def logprobs(self, entries: list[TokenLogprob]) -> dict | None:
        if self.params.logprobs is None:
            return None

        def item(token_id: int, logprob: float) -> dict:
            return {
                "token": self.token_text(token_id),
                "logprob": json_logprob(logprob),
                "bytes": self.token_bytes(token_id),
            }

        content = [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]} for e in entries]
        return {"content": content, "refusal": None}

    def opening_choices(self) -> list[dict]:
        """As OpenAI does, each choice's first chunk carries the role alone."""
        content = None if self.tool_mode is not None else ""  # an answer of tool calls has no content (OpenAI's)
        return [
            {"index": i, "delta": {"role": "assistant", "content": content}, "finish_reason": None, "logprobs": None}
            for i in range(self.params.n)
        ]

    def closing_choices(self) -> list[dict]:
        closing, self.finishing = self.finishing, []
        return closing

    def response_fields(self, finals: list[RequestOutput]) -> dict[str, Any]:
        if self.req.prompt_logprobs is None or not finals:
            return {}
        return {"prompt_logprobs": self.prompt_logprobs(finals[0])}

    def stream_choice(self, out: RequestOutput, sample: CompletionOutput) -> dict | None:
        index = self.choice_index(out, sample)
        if self.tool_mode is not None:
            return self.tool_choice_delta(index, sample)
        delta = {"content": sample.text_delta} if sample.text_delta or sample.new_token_ids else {}
        wants_logprobs = self.params.logprobs is not None and sample.new_logprobs
        if not delta and not sample.finished and not wants_logprobs:
            return None
        choice = {
            "index": index,
            "delta": delta,
            "finish_reason": sample.finish_reason,
            "logprobs": self.logprobs(sample.new_logprobs),
        }
        if sample.finished:
            choice["stop_reason"] = sample.stop_reason
        return choice

    def tool_choice_delta(self, index: int, sample: CompletionOutput) -> dict | None:
        """A streamed choice of a sample that makes forced calls: the named call's arguments as they grow (its
        id, type and name in the first delta), or, for ``required`` calls, empty deltas until the end."""
        delta: dict[str, Any] = {}
        reason = sample.finish_reason
        if self.tool_mode == "named" and (sample.text_delta or index not in self.call_ids):
            call: dict[str, Any] = {"function": {"arguments": sample.text_delta}}
            if index not in self.call_ids:
                self.call_ids[index] = tool_call_id()
                call = self.call(self.call_ids[index], self.tool_name, sample.text_delta)  # type: ignore[arg-type]
            delta = {"tool_calls": [{"index": 0, **call}]}
        elif self.tool_mode == "required":
            self.call_texts.setdefault(index, []).append(sample.text_delta)
            if sample.finished:
                text = "".join(self.call_texts.pop(index))
                calls = self.tool_calls(text) if reason == "stop" else None
                if calls is None:
                    delta = {"content": text}
                else:
                    delta = {"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]}
                    reason = "tool_calls"
        if not delta and not sample.finished and not sample.new_token_ids:
            return None
        if reason is not None and "tool_calls" in delta:
            # As OpenAI's streams end: the finish_reason in a chunk of its own. The openai SDK's stream helper
            # closes the current call when it reads a finish_reason, before that chunk's calls: in one chunk, the
            # last call would never get its `arguments.done` event.
            self.finishing.append(
                {"index": index, "delta": {}, "finish_reason": reason, "logprobs": None, "stop_reason": None}
            )
            reason = None
        logprobs = self.logprobs(sample.new_logprobs)
        choice = {"index": index, "delta": delta, "finish_reason": reason, "logprobs": logprobs}
        if reason is not None:
            choice["stop_reason"] = sample.stop_reason
        return choice

    def final_choice(self, out: RequestOutput, sample: CompletionOutput) -> dict:
        message: dict[str, Any] = {"role": "assistant", "content": sample.text}
        reason = sample.finish_reason
        forced = self.tool_mode == "named" or (self.tool_mode == "required" and reason == "stop")
        calls = self.tool_calls(sample.text) if forced else None
        if calls is not None:
            message = {"role": "assistant", "content": None, "tool_calls": calls}
            reason = "tool_calls" if self.tool_mode == "required" else reason
        return {
            "index": sample.index,
            "message": message,
            "finish_reason": reason,
            "stop_reason": sample.stop_reason,
            "logprobs": self.logprobs(sample.logprobs or []),
        }
