"""The HTTP routes: OpenAI completions and chat completions, models, tokenize/detokenize/tokenizer_info,
health and Prometheus metrics. Handlers validate, submit to the engine and hand the result to ``streaming``."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError

from rnnserve.engine.sampling_params import InvalidParameterError, SamplingParams
from rnnserve.engine.scheduler import QueueFullError
from rnnserve.engine.tokenizer import Tokenizer
from rnnserve.server.async_engine import AsyncEngine, EngineDeadError, Submission
from rnnserve.server.chat_template import (
    DEFAULT_CHAT_TEMPLATE,
    find_chat_template,
    model_directory,
    render_chat,
    special_token_text,
)
from rnnserve.server.config import ServerConfig
from rnnserve.server.errors import APIError, bad_request, from_validation_error
from rnnserve.server.metrics import ServerMetrics
from rnnserve.server.protocol import (
    APIModel,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    SamplingFields,
    TokenizeRequest,
)
from rnnserve.server.streaming import ChatStream, CompletionStream, Generation, sse_response, until_disconnect

ModelT = TypeVar("ModelT", bound=APIModel)

logger = logging.getLogger("rnnserve.server")


async def parse_body(request: Request, model: type[ModelT]) -> ModelT:
    """The request body as ``model``; a 400 naming the first bad field otherwise. Fields the server does not
    know are ignored with a warning in the log (as vLLM does), so newer clients keep working."""
    body = await request.body()
    try:
        parsed = model.model_validate_json(body or b"{}")
    except ValidationError as err:
        raise from_validation_error(err) from err
    unknown = parsed.unknown_fields()
    if unknown:
        logger.warning("%s: ignoring fields this server does not know: %s", request.url.path, ", ".join(unknown))
    return parsed


def client_input(build: Callable[[], Any]) -> Any:
    """Run ``build``; an InvalidParameterError it raises becomes a 400 naming the parameter."""
    try:
        return build()
    except InvalidParameterError as err:
        raise bad_request(str(err), param=err.param) from err


class OpenAIServing:
    """Request handling behind the routes: validation, submission and response shapes."""

    def __init__(self, config: ServerConfig, engine: AsyncEngine, metrics: ServerMetrics) -> None:
        self.config = config
        self.engine = engine
        self.metrics = metrics
        self.tokenizer: Tokenizer = engine.engine.tokenizer
        self.vocab_size = engine.engine.model.vocab_size
        self.created = int(time.time())
        model_dir = model_directory(config.model_path)
        self.chat_template = find_chat_template(self.tokenizer, config.chat_template, model_dir)

    def check_model(self, name: str | None) -> str:
        """The served name a request asked for (the default when omitted); 404 for any other name."""
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
            "root": self.config.model_root,
        }

    async def submit(self, request_id: str, prompts: list[str | list[int]], params: SamplingParams) -> Submission:
        try:
            return await self.engine.submit(request_id, prompts, params)
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

    async def generate(
        self,
        request: Request,
        generation: type[Generation],
        req: SamplingFields,
        model: str,
        prompts: list[str | list[int]],
        params: SamplingParams,
    ) -> Response:
        """Submit the prompts under a new response id and answer with a stream or one JSON body."""
        submission = await self.submit(f"{generation.id_prefix}-{uuid.uuid4().hex}", prompts, params)
        stream = generation(self.tokenizer, submission, req, model, params)
        if req.stream:
            return sse_response(stream.events(), submission)
        return JSONResponse(await until_disconnect(request, stream.collect(), submission))

    async def completions(self, request: Request, req: CompletionRequest) -> Response:
        model = self.check_model(req.model)
        params = client_input(lambda: req.to_sampling_params(16))
        return await self.generate(request, CompletionStream, req, model, client_input(req.prompts), params)

    async def chat_completions(self, request: Request, req: ChatCompletionRequest) -> Response:
        model = self.check_model(req.model)
        params = client_input(lambda: req.to_sampling_params(self.config.chat_default_max_tokens))
        prompt = client_input(
            lambda: self.render(
                req.messages, req.add_generation_prompt, req.continue_final_message, req.chat_template_kwargs
            )
        )
        return await self.generate(request, ChatStream, req, model, [prompt], params)

    def render(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool,
        continue_final_message: bool = False,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        return render_chat(
            self.tokenizer,
            [{"role": m.role, "content": m.text()} for m in messages],
            add_generation_prompt,
            continue_final_message,
            self.chat_template,
            template_kwargs,
        )

    def tokenize(self, req: TokenizeRequest) -> JSONResponse:
        self.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give exactly one of 'prompt' or 'messages'", param="prompt")
        try:
            if req.prompt is not None:
                text = req.prompt
            else:
                text = self.render(req.messages or [], req.add_generation_prompt, False, req.chat_template_kwargs)
            tokens = self.tokenizer.encode(text)
        except (InvalidParameterError, ValueError) as err:
            raise bad_request(str(err), param=getattr(err, "param", "prompt")) from err
        if not req.add_special_tokens and tokens[:1] == self.tokenizer.encode("") != []:
            tokens = tokens[1:]  # the tokenizer adds a BOS token on its own
        limit = self.engine.engine.max_model_len
        return JSONResponse({"tokens": tokens, "count": len(tokens), "max_model_len": limit})

    def tokenizer_info(self) -> JSONResponse:
        """The tokenizer's special tokens and the chat template chat requests are rendered with (vLLM's
        ``/tokenizer_info``, which lm-evaluation-harness's remote tokenizer reads)."""
        tok = self.tokenizer
        return JSONResponse({
            "tokenizer_class": type(tok).__name__,
            "eos_token": special_token_text(tok, tok.eos_token_id) or None,
            "eos_token_id": tok.eos_token_id,
            "bos_token": special_token_text(tok, tok.bos_token_id) or None,
            "bos_token_id": tok.bos_token_id,
            "pad_token": None,
            "vocab_size": tok.vocab_size,
            "model_max_length": self.engine.engine.max_model_len,
            "chat_template": self.chat_template or DEFAULT_CHAT_TEMPLATE,
        })

    def detokenize(self, req: DetokenizeRequest) -> JSONResponse:
        self.check_model(req.model)
        bad = [t for t in req.tokens if not 0 <= t < self.vocab_size]
        if bad:
            raise bad_request(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})", param="tokens")
        return JSONResponse({"prompt": self.tokenizer.decode(req.tokens)})


def api_router(serving: OpenAIServing) -> APIRouter:
    """Every route of the server, bound to ``serving``."""
    router = APIRouter()

    @router.get("/ready")
    async def ready() -> JSONResponse:
        reason = serving.engine.not_ready_reason()
        if reason is not None:
            return APIError(503, reason, type="service_unavailable").response()
        return JSONResponse({"status": "ready"})

    @router.get("/version")
    async def version(request: Request) -> JSONResponse:
        return JSONResponse({"version": request.app.version})

    @router.get("/health")
    async def health(request: Request) -> JSONResponse:
        if "ready" in request.query_params:
            return await ready()
        if not serving.engine.running:
            return APIError(503, "engine is not running", type="service_unavailable").response()
        return JSONResponse({"status": "ok"})

    @router.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(serving.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @router.get("/v1/models")
    async def list_models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [serving.model_card(n) for n in serving.config.model_names]})

    @router.get("/v1/models/{name:path}")
    async def get_model(name: str) -> JSONResponse:
        serving.check_model(name)
        return JSONResponse(serving.model_card(name))

    @router.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serving.completions(request, await parse_body(request, CompletionRequest))

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await serving.chat_completions(request, await parse_body(request, ChatCompletionRequest))

    @router.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        return serving.tokenize(await parse_body(request, TokenizeRequest))

    @router.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        return serving.detokenize(await parse_body(request, DetokenizeRequest))

    @router.get("/tokenizer_info")
    async def tokenizer_info() -> JSONResponse:
        return serving.tokenizer_info()

    return router
