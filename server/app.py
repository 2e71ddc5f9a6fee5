"""The OpenAI-compatible HTTP server: app factory, routes, auth and body-size guard.

Build an app for any model the loader knows and drive it in-process (the engine thread starts with the
app's lifespan, so use ``TestClient`` as a context manager)::

    from fastapi.testclient import TestClient
    from rnnserve.server.app import ServerConfig, create_app

    app = create_app(ServerConfig(model="lsrl:dictionary", max_num_seqs=4))
    with TestClient(app) as client:
        r = client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 8, "temperature": 0})
        print(r.json()["choices"][0]["text"])

``create_app(config, engine=an_LLMEngine)`` serves an engine built elsewhere. Routes: ``POST
/v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``, ``POST /tokenize``, ``POST
/detokenize``, ``GET /health``, ``GET /metrics``. With ``api_key`` set, ``/v1/*``, ``/tokenize`` and
``/detokenize`` need ``Authorization: Bearer <key>``; ``/health`` and ``/metrics`` stay open.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rnnserve.engine.llm_engine import LLMEngine
from rnnserve.engine.loader import DEFAULT_MODEL_DIR
from rnnserve.engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from rnnserve.engine.sampling_params import InvalidParameterError, SamplingParams
from rnnserve.engine.scheduler import QueueFullError
from rnnserve.engine.tokenizer import ByteTokenizer, Tokenizer
from rnnserve.server.async_engine import AsyncEngine, EngineDeadError, Submission
from rnnserve.server.chat_template import render_chat
from rnnserve.server.errors import APIError, bad_request, from_validation_error
from rnnserve.server.metrics import ServerMetrics
from rnnserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    SamplingFields,
    TokenizeRequest,
)

logger = logging.getLogger("rnnserve.server")

DEFAULT_SERVED_NAME = "rnnserve-default"
PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")


@dataclass
class ServerConfig:
    """Everything ``rnnserve serve`` configures. ``model=None`` serves the embedded default model."""

    model: str | None = None
    served_model_name: list[str] = field(default_factory=list)
    device: str = "auto"
    dtype: str | None = None
    max_num_seqs: int | None = 64
    state_memory: int | None = None
    max_num_batched_tokens: int = 2048
    max_prompt_tokens: int | None = None
    max_waiting: int | None = 256
    enforce_eager: bool = False
    api_key: str | None = None
    max_body_bytes: int = 1 << 20
    chat_default_max_tokens: int = 256
    retry_after_seconds: int = 1

    @property
    def model_path(self) -> str:
        return self.model if self.model is not None else str(DEFAULT_MODEL_DIR)

    @property
    def model_names(self) -> list[str]:
        if self.served_model_name:
            return list(self.served_model_name)
        return [self.model if self.model is not None else DEFAULT_SERVED_NAME]


def build_engine(config: ServerConfig) -> LLMEngine:
    """Load the model and size the state pool (raises ``ModelLoadError`` or ``ValueError``)."""
    return LLMEngine.from_name(
        config.model_path,
        device=config.device,
        dtype=config.dtype,
        max_num_seqs=config.max_num_seqs,
        state_memory=config.state_memory,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_prompt_tokens=config.max_prompt_tokens,
        max_waiting=config.max_waiting,
        enforce_eager=config.enforce_eager,
    )


class RequestGuard:
    """ASGI middleware: API-key check (constant-time) and a request-body size limit, before any parsing."""

    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v for k, v in scope["headers"]}
        if self.api_key is not None and scope["path"].startswith(PROTECTED_PREFIXES):
            auth = headers.get("authorization", b"")
            token = auth[7:].strip() if auth[:7].lower() == b"bearer " else b""
            if not hmac.compare_digest(token, self.api_key):
                error = APIError(
                    401,
                    "missing or invalid API key (send 'Authorization: Bearer <key>')",
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
                await error.response()(scope, receive, send)
                return
        declared = headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_body_bytes):
            await self._too_large()(scope, receive, send)
            return
        if scope["method"] in ("GET", "HEAD"):
            await self.app(scope, receive, send)
            return
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if len(body) > self.max_body_bytes:
                await self._too_large()(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    def _too_large(self) -> JSONResponse:
        return APIError(
            413, f"request body is larger than {self.max_body_bytes} bytes", code="request_too_large"
        ).response()


ModelT = TypeVar("ModelT", bound=BaseModel)


async def parse_body(request: Request, model: type[ModelT]) -> ModelT:
    body = await request.body()
    try:
        return model.model_validate_json(body or b"{}")
    except ValidationError as err:
        raise from_validation_error(err) from err


def create_app(config: ServerConfig, engine: LLMEngine | None = None) -> FastAPI:
    """Build the FastAPI app (loads the model unless ``engine`` is given); the engine thread runs with
    the app's lifespan."""
    engine = engine if engine is not None else build_engine(config)
    metrics = ServerMetrics()
    async_engine = AsyncEngine(engine, metrics)
    server = OpenAIServing(config, async_engine)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async_engine.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            await asyncio.to_thread(async_engine.stop)

    app = FastAPI(title="rnnserve", version="0.1.0", lifespan=lifespan)
    app.state.config = config
    app.state.engine = async_engine
    app.state.metrics = metrics
    app.add_middleware(RequestGuard, api_key=config.api_key, max_body_bytes=config.max_body_bytes)

    @app.exception_handler(APIError)
    async def api_error(_: Request, err: APIError) -> JSONResponse:
        return err.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, err: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if err.status_code == 404 else None
        return APIError(err.status_code, str(err.detail), code=code).response()

    @app.exception_handler(Exception)
    async def internal_error(_: Request, err: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return APIError(500, "internal server error", type="internal_error").response()

    @app.get("/health")
    async def health() -> JSONResponse:
        if not async_engine.running:
            return APIError(503, "engine is not running", type="service_unavailable").response()
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def list_models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [server.model_card(n) for n in config.model_names]})

    @app.get("/v1/models/{name:path}")
    async def get_model(name: str) -> JSONResponse:
        server.check_model(name)
        return JSONResponse(server.model_card(name))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await server.completions(request, await parse_body(request, CompletionRequest))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await server.chat_completions(request, await parse_body(request, ChatCompletionRequest))

    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        return server.tokenize(await parse_body(request, TokenizeRequest))

    @app.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        return server.detokenize(await parse_body(request, DetokenizeRequest))

    return app


class OpenAIServing:
    """Request handling shared by the routes: validation, submission, streaming and response shapes."""

    def __init__(self, config: ServerConfig, engine: AsyncEngine) -> None:
        self.config = config
        self.engine = engine
        self.tokenizer: Tokenizer = engine.engine.tokenizer
        self.vocab_size = engine.engine.model.vocab_size
        self.created = int(time.time())

    # --- helpers -------------------------------------------------------------------------------------

    def check_model(self, name: str | None) -> str:
        if name is None or name == "":
            return self.config.model_names[0]
        if name not in self.config.model_names:
            raise APIError(
                404,
                f"model {name!r} does not exist; this server serves {self.config.model_names}",
                param="model",
                code="model_not_found",
            )
        return name

    def model_card(self, name: str) -> dict[str, Any]:
        return {
            "id": name,
            "object": "model",
            "created": self.created,
            "owned_by": "rnnserve",
            "root": self.config.model_path,
        }

    async def submit(self, prompts: list[str | list[int]], params: SamplingParams) -> Submission:
        try:
            return await self.engine.submit(prompts, params)
        except InvalidParameterError as err:
            raise bad_request(str(err), param=err.param) from err
        except QueueFullError as err:
            raise APIError(
                429,
                f"server is busy: {err}; retry later",
                type="rate_limit_error",
                code="queue_full",
                headers={"Retry-After": str(self.config.retry_after_seconds)},
            ) from err
        except EngineDeadError as err:
            raise APIError(503, str(err), type="service_unavailable") from err
        except ValueError as err:  # the tokenizer rejected the text (e.g. a character outside an alphabet)
            raise bad_request(str(err), param="prompt") from err

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def token_bytes(self, token_id: int) -> list[int]:
        if isinstance(self.tokenizer, ByteTokenizer) and token_id < 256:
            return [token_id]
        return list(self.token_text(token_id).encode())

    @staticmethod
    def params_or_400(build: Callable[[], SamplingParams]) -> SamplingParams:
        try:
            return build()
        except InvalidParameterError as err:
            raise bad_request(str(err), param=err.param) from err

    # --- endpoints -----------------------------------------------------------------------------------

    async def completions(self, request: Request, req: CompletionRequest) -> Response:
        model = self.check_model(req.model)
        params = self.params_or_400(lambda: req.to_sampling_params(16))
        try:
            prompts = req.prompts()
        except InvalidParameterError as err:
            raise bad_request(str(err), param=err.param) from err
        submission = await self.submit(prompts, params)
        stream = CompletionStream(self, submission, req, model, params)
        if req.stream:
            return sse_response(stream.events(), submission)
        return JSONResponse(await until_disconnect(request, stream.collect(), submission))

    async def chat_completions(self, request: Request, req: ChatCompletionRequest) -> Response:
        model = self.check_model(req.model)
        params = self.params_or_400(lambda: req.to_sampling_params(self.config.chat_default_max_tokens))
        try:
            prompt = self.render(req.messages, req.add_generation_prompt, req.continue_final_message)
        except InvalidParameterError as err:
            raise bad_request(str(err), param=err.param) from err
        submission = await self.submit([prompt], params)
        stream = ChatStream(self, submission, req, model, params)
        if req.stream:
            return sse_response(stream.events(), submission)
        return JSONResponse(await until_disconnect(request, stream.collect(), submission))

    def render(self, messages: list, add_generation_prompt: bool, continue_final_message: bool = False) -> str:
        return render_chat(
            self.tokenizer,
            [{"role": m.role, "content": m.text()} for m in messages],
            add_generation_prompt,
            continue_final_message,
        )

    def tokenize(self, req: TokenizeRequest) -> JSONResponse:
        self.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give exactly one of 'prompt' or 'messages'", param="prompt")
        try:
            text = req.prompt if req.prompt is not None else self.render(req.messages or [], req.add_generation_prompt)
            tokens = self.tokenizer.encode(text)
        except (InvalidParameterError, ValueError) as err:
            raise bad_request(str(err), param=getattr(err, "param", "prompt")) from err
        limit = self.config.max_prompt_tokens
        return JSONResponse({"tokens": tokens, "count": len(tokens), "max_model_len": limit})

    def detokenize(self, req: DetokenizeRequest) -> JSONResponse:
        self.check_model(req.model)
        bad = [t for t in req.tokens if not 0 <= t < self.vocab_size]
        if bad:
            raise bad_request(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})", param="tokens")
        return JSONResponse({"prompt": self.tokenizer.decode(req.tokens)})


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
        return task.result()
    except EngineDeadError as err:
        raise APIError(503, str(err), type="service_unavailable") from err
    finally:
        watcher.cancel()
        submission.abort()


class _Generation(ABC):
    """Common state of one (possibly multi-prompt) generation being turned into API responses."""

    chunk_object_name = ""

    def __init__(
        self,
        serving: OpenAIServing,
        submission: Submission,
        req: SamplingFields,
        model: str,
        params: SamplingParams,
    ) -> None:
        self.serving = serving
        self.submission = submission
        self.req = req
        self.model = model
        self.params = params
        self.id = f"{'chatcmpl' if isinstance(req, ChatCompletionRequest) else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.prompt_index = {rid: i for i, rid in enumerate(submission.request_ids)}
        self.prompt_tokens: dict[str, int] = {}
        self.completion_tokens: dict[tuple[str, int], int] = {}

    def choice_index(self, out: RequestOutput, sample: CompletionOutput) -> int:
        return self.prompt_index[out.request_id] * self.params.n + sample.index

    def record(self, out: RequestOutput) -> None:
        self.prompt_tokens[out.request_id] = len(out.prompt_token_ids)
        for sample in out.outputs:
            self.completion_tokens[(out.request_id, sample.index)] = len(sample.token_ids)

    def usage(self) -> dict[str, int]:
        prompt, completion = sum(self.prompt_tokens.values()), sum(self.completion_tokens.values())
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def chunk(self, choices: list[dict], usage: dict | None = None) -> str:
        body = {
            "id": self.id,
            "object": self.chunk_object_name,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if self.req.include_usage:
            options = self.req.stream_options
            body["usage"] = self.usage() if usage is None and options and options.continuous_usage_stats else usage
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    async def final_outputs(self) -> dict[str, RequestOutput]:
        final: dict[str, RequestOutput] = {}
        async for out in self.submission.outputs():
            self.record(out)
            if out.finished:
                final[out.request_id] = out
        return final

    async def events(self) -> AsyncIterator[str]:
        """SSE events: chunks, an optional usage chunk, ``[DONE]``; an error event if the engine fails."""
        try:
            async for out in self.submission.outputs():
                self.record(out)
                choices = [c for sample in out.outputs if (c := self.stream_choice(out, sample)) is not None]
                if choices:
                    yield self.chunk(choices)
            if self.req.include_usage:
                yield self.chunk([], self.usage())
        except Exception as err:  # engine failure mid-stream: tell the client instead of hanging
            logger.exception("generation failed mid-stream")
            yield APIError(500, f"generation failed: {err}", type="internal_error").sse()
        yield "data: [DONE]\n\n"

    @abstractmethod
    def stream_choice(self, out: RequestOutput, sample: CompletionOutput) -> dict | None:
        """The streamed choice for one sample's progress this step, or None when there is nothing to send."""


class CompletionStream(_Generation):
    chunk_object_name = "text_completion"

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.offsets: dict[int, int] = {}
        self.echoed: set[int] = set()

    def prompt_text(self, out: RequestOutput) -> str:
        return out.prompt if out.prompt is not None else self.serving.tokenizer.decode(out.prompt_token_ids)

    def logprobs(self, index: int, entries: list[TokenLogprob]) -> dict:
        text = self.serving.token_text
        tokens = [text(e.token_id) for e in entries]
        offsets = []
        offset = self.offsets.get(index, 0)
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        self.offsets[index] = offset
        return {
            "tokens": tokens,
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{text(t): lp for t, lp in e.top} for e in entries],
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
            "logprobs": self.logprobs(index, sample.new_logprobs) if self.params.logprobs is not None else None,
        }

    async def collect(self) -> dict:
        final = await self.final_outputs()
        choices = []
        for request_id in self.submission.request_ids:
            out = final[request_id]
            for sample in out.outputs:
                index = self.choice_index(out, sample)
                text = (self.prompt_text(out) if self.req.echo else "") + sample.text
                logprobs = self.logprobs(index, sample.logprobs or []) if self.params.logprobs is not None else None
                choices.append(
                    {
                        "index": index,
                        "text": text,
                        "finish_reason": sample.finish_reason,
                        "logprobs": logprobs,
                    }
                )
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": sorted(choices, key=lambda c: c["index"]),
            "usage": self.usage(),
        }


class ChatStream(_Generation):
    chunk_object_name = "chat.completion.chunk"

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.started: set[int] = set()

    def logprobs(self, entries: list[TokenLogprob]) -> dict:
        s = self.serving

        def item(token_id: int, logprob: float) -> dict:
            return {"token": s.token_text(token_id), "logprob": logprob, "bytes": s.token_bytes(token_id)}

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
            "logprobs": self.logprobs(sample.new_logprobs) if self.params.logprobs is not None else None,
        }

    async def collect(self) -> dict:
        out = (await self.final_outputs())[self.submission.request_ids[0]]
        choices = [
            {
                "index": sample.index,
                "message": {"role": "assistant", "content": sample.text},
                "finish_reason": sample.finish_reason,
                "logprobs": self.logprobs(sample.logprobs or []) if self.params.logprobs is not None else None,
            }
            for sample in out.outputs
        ]
        return {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self.usage(),
        }
