"""The HTTP routes: OpenAI completions and chat completions, persistent sessions, models,
tokenize/detokenize/tokenizer_info, health and Prometheus metrics. Handlers validate, submit to the engine and
hand the result to ``streaming``."""

from __future__ import annotations

import asyncio
import logging
import random
import time
import weakref
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError

from rnnserve.engine.chat_template import (
    DEFAULT_CHAT_TEMPLATE,
    find_chat_template,
    model_directory,
    render_chat,
    special_token_text,
)
from rnnserve.engine.sampling_params import InvalidParameterError, SamplingParams
from rnnserve.engine.scheduler import QueueFullError
from rnnserve.engine.tokenizer import CharTokenizer, Tokenizer
from rnnserve.server.async_engine import AsyncEngine, EngineDeadError, Submission
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
    SessionRequest,
    TokenizeRequest,
)
from rnnserve.server.sessions import SessionStore, SessionTurn, StoredSession, check_session_id
from rnnserve.server.streaming import (
    ChatStream,
    CompletionStream,
    EventStreamResponse,
    Generation,
    unless_disconnected,
    until_disconnect,
)

ModelT = TypeVar("ModelT", bound=APIModel)

STATE_MEDIA_TYPE = "application/octet-stream"
# A session continues a chat after the assistant's last reply: the template renders a placeholder exchange
# ending in this assistant content, then the new messages, and the text after it is the continuation.
SESSION_MARKER = "rnnserve-session-continues-here"

logger = logging.getLogger("rnnserve.server")
LOGGED_NAMES = 20  # unknown field names a request's warning lists
LOGGED_NAME_CHARS = 100  # characters of each (escaped)


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
        logger.warning("%s: ignoring fields this server does not know: %s", request.url.path, loggable_names(unknown))
    return parsed


def loggable_names(names: list[str]) -> str:
    """Client-chosen names for one log line: each escaped (a newline or a terminal escape in a name cannot forge a
    line or colour the log) and cut to :data:`LOGGED_NAME_CHARS`, at most :data:`LOGGED_NAMES` of them."""
    shown = [name.encode("unicode_escape").decode("ascii")[:LOGGED_NAME_CHARS] for name in names[:LOGGED_NAMES]]
    more = len(names) - len(shown)
    return ", ".join(shown) + (f" (and {more} more)" if more else "")


def client_input(build: Callable[[], Any]) -> Any:
    """Run ``build``; an InvalidParameterError it raises becomes a 400 naming the parameter."""
    try:
        return build()
    except InvalidParameterError as err:
        raise bad_request(str(err), param=err.param) from err


class UnencodablePromptError(InvalidParameterError):
    """The tokenizer cannot encode a prompt's text (a character outside a fixed alphabet)."""


class OpenAIServing:
    """Request handling behind the routes: validation, submission and response shapes."""

    def __init__(
        self, config: ServerConfig, engine: AsyncEngine, metrics: ServerMetrics, sessions: SessionStore | None = None
    ) -> None:
        self.config = config
        self.engine = engine
        self.metrics = metrics
        self.sessions = sessions
        self.tokenizer: Tokenizer = engine.info.tokenizer
        self.vocab_size = engine.info.vocab_size
        self.created = int(time.time())
        self.model_names = config.model_names  # resolved once: it looks at the file system
        model_dir = model_directory(config.model_path)
        self.chat_template = find_chat_template(self.tokenizer, config.chat_template, model_dir)

    def check_model(self, name: str | None) -> str:
        """The served name a request asked for (the default when omitted); 404 for any other name."""
        if name is None or name == "":
            return self.model_names[0]
        if name not in self.model_names:
            raise APIError(
                404,
                f"model {name!r} does not exist; this server serves {self.model_names}",
                param="model",
                code="model_not_found",
            )
        return name

    def model_card(self, name: str) -> dict[str, Any]:
        """OpenAI's model object with vLLM's ``root``, ``parent`` and ``max_model_len`` (clients built for vLLM size
        their prompts by it)."""
        return {
            "id": name,
            "object": "model",
            "created": self.created,
            "owned_by": "rnnserve",
            "root": self.config.model_root,
            "parent": None,
            "max_model_len": self.engine.info.max_model_len,
        }

    async def submit(
        self,
        request_id: str,
        prompts: list[str | list[int]],
        params: SamplingParams,
        turn: SessionTurn | None = None,
        explain: Callable[[InvalidParameterError], InvalidParameterError] = lambda err: err,
    ) -> Submission:
        """Hand the prompts to the engine; its refusals become 400 / 429 / 503, a 400 named by ``explain`` in the
        request's own terms."""
        context = turn.context if turn is not None else None
        limit = self.config.engine.max_waiting
        if limit is not None and len(prompts) > limit:  # a 429 would have it retried forever
            raise bad_request(
                f"{len(prompts)} prompts in one request; this server queues at most {limit} (--max-waiting)",
                param="prompt",
            )
        try:
            return await self.engine.submit(request_id, prompts, params, context, return_state=turn is not None)
        except InvalidParameterError as err:
            explained = explain(err)
            raise bad_request(str(explained), param=explained.param) from err
        except QueueFullError as err:
            raise APIError(
                429,
                f"server is busy: {err}; retry later",
                type="rate_limit_error",
                code="queue_full",
                headers={"Retry-After": str(self.config.retry_after_seconds)},
                retryable=True,
            ) from err
        except EngineDeadError as err:
            raise APIError(503, str(err), type="service_unavailable", retryable=True) from err
        except ValueError as err:  # the tokenizer rejected the text (e.g. a character outside an alphabet)
            explained = explain(UnencodablePromptError("prompt", str(err)))
            raise bad_request(str(explained), param=explained.param) from err

    async def generate(
        self,
        request: Request,
        generation: type[Generation],
        req: SamplingFields,
        model: str,
        prompts: list[str | list[int]],
        params: SamplingParams,
        turn: SessionTurn | None = None,
        explain: Callable[[InvalidParameterError], InvalidParameterError] | None = None,
    ) -> Response:
        """Submit the prompts under a new response id and answer with a stream or one JSON body. With a session
        ``turn``, the state after the answer is stored before its end is sent, and the session is given back
        when the response ends, however it ends. ``explain`` words the engine's refusals in the request's terms
        (default: the request's own ``in_request_terms``)."""
        try:
            # 128 random bits, not uuid4: its os.urandom call releases the GIL, and with the engine in a thread
            # each request then waited for the engine to hand the GIL back.
            response_id = f"{generation.id_prefix}-{random.getrandbits(128):032x}"
            submitting = self.submit(response_id, prompts, params, turn, explain or req.in_request_terms)
            if params.structured_outputs is None:  # answered at once; a grammar may wait to compile
                submission = await submitting
            else:
                submission = await unless_disconnected(request.receive, submitting)
        except BaseException:
            if turn is not None:
                turn.release()
            raise
        if turn is not None:
            submission.on_finished = turn.store_state
            submission.on_close.append(turn.release)
            weakref.finalize(submission, turn.release_soon)  # also if the response is dropped before it starts
        stream = generation(self.tokenizer, submission, req, model, params)
        if req.stream:
            return EventStreamResponse(stream)
        return JSONResponse(await until_disconnect(request, stream.collect(), submission))

    async def completions(self, request: Request, req: CompletionRequest) -> Response:
        """``POST /v1/completions``: a new generation, or the next turn of ``session_id``'s session."""
        model = self.check_model(req.model)
        params = client_input(req.to_sampling_params)
        prompts: list[str | list[int]] = client_input(req.prompts)
        if req.session_id is None:
            return await self.generate(request, CompletionStream, req, model, prompts, params)
        self.check_session_request(req, params)
        if req.echo:
            raise bad_request("echo cannot be combined with session_id", param="echo")
        if len(prompts) != 1:
            raise bad_request("a session continues one prompt: send a string or one list of token ids", param="prompt")
        turn, prompt = await self.open_turn(req.session_id, lambda stored: self.continuation(prompts[0], stored))
        return await self.generate(request, CompletionStream, req, model, [prompt], params, turn)

    async def chat_completions(self, request: Request, req: ChatCompletionRequest) -> Response:
        """``POST /v1/chat/completions``: the messages rendered with the chat template, or the next turn of
        ``session_id``'s session."""
        model = self.check_model(req.model)
        params = client_input(lambda: req.to_sampling_params(self.config.chat_default_max_tokens))
        if req.session_id is None:
            prompt = client_input(
                lambda: self.render(
                    req.messages, req.add_generation_prompt, req.continue_final_message, req.template_kwargs()
                )
            )
            explain = self.in_chat_terms(req, prompt)
            return await self.generate(request, ChatStream, req, model, [prompt], params, explain=explain)
        self.check_session_request(req, params)
        turn, session_prompt = await self.open_turn(
            req.session_id, lambda stored: client_input(lambda: self.render_turn(req, stored))
        )
        explain = self.in_chat_terms(req, session_prompt)
        return await self.generate(request, ChatStream, req, model, [session_prompt], params, turn, explain=explain)

    def in_chat_terms(
        self, req: ChatCompletionRequest, prompt: str | list[int]
    ) -> Callable[[InvalidParameterError], InvalidParameterError]:
        """The engine's refusals in the chat request's terms (``in_request_terms``: e.g. its
        ``max_completion_tokens``), those of the prompt its messages rendered to as errors on ``messages`` (the field
        the client sent); a text the tokenizer cannot encode is shown as the template rendered it."""

        def explain(err: InvalidParameterError) -> InvalidParameterError:
            err = req.in_request_terms(err)
            if err.param != "prompt":
                return err
            if not isinstance(err, UnencodablePromptError):
                return InvalidParameterError("messages", f"the prompt rendered from the messages: {err}")
            shown = repr(prompt if len(prompt) <= 80 else prompt[:80]) + ("..." if len(prompt) > 80 else "")
            message = f"the chat template renders the messages as {shown}, which this model cannot read: {err}"
            if isinstance(self.tokenizer, CharTokenizer):
                message += (
                    ". A model with a fixed alphabet (a compiled LSRL program) has no chat format: send text in its "
                    "alphabet to /v1/completions, or serve it with a --chat-template that writes only its symbols"
                )
            return InvalidParameterError("messages", message)

        return explain

    # --- sessions -------------------------------------------------------------------------------------

    def session_store(self) -> SessionStore:
        """The session store; 404 when the server runs with ``--no-sessions``."""
        if self.sessions is None:
            raise APIError(404, "sessions are turned off on this server (--no-sessions)", code="sessions_disabled")
        return self.sessions

    def check_session_request(self, req: SamplingFields, params: SamplingParams) -> None:
        """400 for what a session request cannot have: sessions off, a malformed id, ``n > 1``, prompt logprobs."""
        if self.sessions is None:
            raise bad_request(
                "session_id was given but sessions are turned off on this server (--no-sessions)",
                param="session_id",
                code="sessions_disabled",
            )
        check_session_id(req.session_id or "", param="session_id")
        if params.n != 1:
            raise bad_request(f"a session continues one sample: n must be 1, got {params.n}", param="n")
        if req.prompt_logprobs is not None:
            raise bad_request("prompt_logprobs cannot be combined with session_id", param="prompt_logprobs")

    async def open_turn(
        self, session_id: str, prompt_for: Callable[[StoredSession], str | list[int]]
    ) -> tuple[SessionTurn, str | list[int]]:
        """Take the session for one request (409 while another has it), load its state (404, 422) and build
        the request's prompt from it; the session is given back if anything fails."""
        store = self.session_store()
        lease = store.acquire(session_id)
        try:
            stored = await asyncio.to_thread(store.load, session_id, True)
            return SessionTurn(store, lease, stored), prompt_for(stored)
        except BaseException:
            lease.release()
            raise

    def continuation(self, prompt: str | list[int], stored: StoredSession) -> str | list[int]:
        """The prompt a session request sends to the engine: as given on the first turn; on later turns the
        text's token ids without the prefix (BOS) the tokenizer puts before every text, which begins the
        history only once."""
        if stored.snapshot is None or not isinstance(prompt, str):
            return prompt
        prefix = self.tokenizer.encode("")
        if not prefix:
            return prompt
        try:
            ids = self.tokenizer.encode(prompt)
        except ValueError as err:
            raise bad_request(str(err), param="prompt") from err
        return ids[len(prefix) :] if ids[: len(prefix)] == prefix else ids

    def render_turn(self, req: ChatCompletionRequest, stored: StoredSession) -> str | list[int]:
        """A session's chat prompt. The first turn renders the messages as any chat request does. Later turns
        hold only the new messages, rendered as the template goes on after an assistant reply: the reply's
        end-of-turn text, the new messages, the generation prompt. When the session's history already ends
        with the EOS token, the EOS text the template would repeat is left out."""
        options = (req.add_generation_prompt, req.continue_final_message, req.template_kwargs())
        if stored.snapshot is None:
            return self.render(req.messages, *options)
        placeholder = [ChatMessage(role=role, content=SESSION_MARKER) for role in ("user", "assistant")]
        text = self.render(placeholder + req.messages, *options)
        parts = text.split(SESSION_MARKER, 2)
        if len(parts) != 3:
            raise InvalidParameterError(
                "messages", "the chat template does not keep messages' text verbatim, so it cannot continue a session"
            )
        text = parts[2]
        eos = special_token_text(self.tokenizer, self.tokenizer.eos_token_id)
        if eos and stored.last_token_id == self.tokenizer.eos_token_id and text.startswith(eos):
            text = text[len(eos) :]
        return self.continuation(text, stored)

    async def create_session(self, req: SessionRequest) -> JSONResponse:
        store = self.session_store()
        model = self.check_model(req.model)
        info = await asyncio.to_thread(store.create)
        return JSONResponse(info.to_json(model))

    async def get_session(self, session_id: str) -> JSONResponse:
        """``GET /v1/sessions/{id}``: the session's description."""
        store = self.session_store()
        info = await asyncio.to_thread(store.info, check_session_id(session_id))
        return JSONResponse(info.to_json(self.model_names[0]))

    async def delete_session(self, session_id: str) -> JSONResponse:
        store = self.session_store()
        await asyncio.to_thread(store.delete, check_session_id(session_id))
        return JSONResponse({"id": session_id, "object": "session", "deleted": True})

    async def fork_session(self, session_id: str) -> JSONResponse:
        store = self.session_store()
        info = await asyncio.to_thread(store.fork, check_session_id(session_id))
        return JSONResponse(info.to_json(self.model_names[0]))

    async def export_session(self, session_id: str) -> Response:
        store = self.session_store()
        data = await asyncio.to_thread(store.export, check_session_id(session_id))
        disposition = f'attachment; filename="{session_id}.safetensors"'
        return Response(data, media_type=STATE_MEDIA_TYPE, headers={"Content-Disposition": disposition})

    async def import_session(self, request: Request, session_id: str) -> JSONResponse:
        store = self.session_store()
        check_session_id(session_id)
        media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if media_type != STATE_MEDIA_TYPE:
            raise APIError(
                415, f"send a session state as 'Content-Type: {STATE_MEDIA_TYPE}'", code="unsupported_media_type"
            )
        body = await request.body()
        info, created = await asyncio.to_thread(store.import_state, session_id, body)
        return JSONResponse(info.to_json(self.model_names[0]), status_code=201 if created else 200)

    def render(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool,
        continue_final_message: bool = False,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """``messages`` as prompt text, through the chat template."""
        return render_chat(
            self.tokenizer,
            [m.template_fields() for m in messages],
            add_generation_prompt,
            continue_final_message,
            self.chat_template,
            template_kwargs,
        )

    def tokenize(self, req: TokenizeRequest) -> JSONResponse:
        """``POST /tokenize``: the token ids of a prompt, or of chat messages rendered with the template."""
        self.check_model(req.model)
        client_input(req.check_unserved_fields)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give exactly one of 'prompt' or 'messages'", param="prompt")
        try:
            if req.prompt is not None:
                text = req.prompt
            else:
                text = self.render(
                    req.messages or [], req.add_generation_prompt, req.continue_final_message, req.template_kwargs()
                )
            tokens = self.tokenizer.encode(text) if req.add_special_tokens else self.tokenizer.encode_plain(text)
        except (InvalidParameterError, ValueError) as err:
            field = "prompt" if req.prompt is not None else "messages"
            raise bad_request(str(err), param=getattr(err, "param", field)) from err
        limit = self.engine.info.max_model_len
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
            "model_max_length": self.engine.info.max_model_len,
            "chat_template": self.chat_template or DEFAULT_CHAT_TEMPLATE,
        })

    def detokenize(self, req: DetokenizeRequest) -> JSONResponse:
        """``POST /detokenize``: the text of token ids; ids outside the vocabulary, or that the tokenizer cannot
        decode, are a 400."""
        self.check_model(req.model)
        bad = [t for t in req.tokens if not 0 <= t < self.vocab_size]
        if bad:
            raise bad_request(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})", param="tokens")
        undecodable = self.tokenizer.first_undecodable(req.tokens)
        if undecodable is not None:  # a model's padding row past its tokenizer, as a prompt's ids are refused
            raise bad_request(f"token id {undecodable} is not in the tokenizer's vocabulary", param="tokens")
        return JSONResponse({"prompt": self.tokenizer.decode_with_specials(req.tokens)})


def add_generation_route(router: APIRouter, path: str, endpoint: Callable[[Request], Awaitable[Response]]) -> None:
    """Serve ``POST path`` with ``endpoint`` (which takes the request alone and parses its body itself) called
    as Starlette calls it, without FastAPI's per-request dependency solving and exit stacks: ~50 us less of
    the serving process's CPU per request. A FastAPI route after it, which requests never reach, lists it in
    the OpenAPI schema all the same."""
    router.add_route(path, endpoint, methods=["POST"], include_in_schema=False)
    router.add_api_route(path, endpoint, methods=["POST"])


def add_api_routes(router: APIRouter, serving: OpenAIServing) -> None:
    """Add every route of the server, bound to ``serving``, to ``router`` (the app's own: an included router
    costs FastAPI another matching layer per request). The generation routes come first: a request is matched
    against the routes in order."""

    async def completions(request: Request) -> Response:
        return await serving.completions(request, await parse_body(request, CompletionRequest))

    async def chat_completions(request: Request) -> Response:
        return await serving.chat_completions(request, await parse_body(request, ChatCompletionRequest))

    add_generation_route(router, "/v1/completions", completions)
    add_generation_route(router, "/v1/chat/completions", chat_completions)

    @router.get("/ready")
    async def ready() -> JSONResponse:
        reason = serving.engine.not_ready_reason()
        if reason is not None:
            return APIError(503, reason, type="service_unavailable", retryable=True).response()
        return JSONResponse({"status": "ready"})

    @router.get("/version")
    async def version(request: Request) -> JSONResponse:
        return JSONResponse({"version": request.app.version})

    @router.get("/health")
    async def health(request: Request) -> JSONResponse:
        if "ready" in request.query_params:
            return await ready()
        if not serving.engine.running:
            return APIError(503, "engine is not running", type="service_unavailable", retryable=True).response()
        return JSONResponse({"status": "ok"})

    @router.get("/metrics")
    async def prometheus_metrics() -> Response:
        # in a thread: a collection reads /proc for the processes' series (and, with several API servers, the
        # shared metrics' files), which would stall every stream of this server while it lasted
        return Response(await asyncio.to_thread(serving.metrics.render), media_type=CONTENT_TYPE_LATEST)

    @router.get("/v1/models")
    async def list_models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [serving.model_card(n) for n in serving.model_names]})

    @router.get("/v1/models/{name:path}")
    async def get_model(name: str) -> JSONResponse:
        if not name:  # check_model takes "" as a request's omitted model: the default one
            raise APIError(404, "name a model: GET /v1/models/{model} (GET /v1/models lists them)",
                           param="model", code="model_not_found")  # fmt: skip
        return JSONResponse(serving.model_card(serving.check_model(name)))

    @router.post("/v1/sessions")
    async def create_session(request: Request) -> JSONResponse:
        serving.session_store()
        return await serving.create_session(await parse_body(request, SessionRequest))

    @router.get("/v1/sessions/{session_id}")
    async def get_session(session_id: str) -> JSONResponse:
        return await serving.get_session(session_id)

    @router.delete("/v1/sessions/{session_id}")
    async def delete_session(session_id: str) -> JSONResponse:
        return await serving.delete_session(session_id)

    @router.post("/v1/sessions/{session_id}/fork")
    async def fork_session(session_id: str) -> JSONResponse:
        return await serving.fork_session(session_id)

    @router.get("/v1/sessions/{session_id}/state")
    async def export_session(session_id: str) -> Response:
        return await serving.export_session(session_id)

    @router.put("/v1/sessions/{session_id}/state")
    async def import_session(request: Request, session_id: str) -> JSONResponse:
        return await serving.import_session(request, session_id)

    @router.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        return serving.tokenize(await parse_body(request, TokenizeRequest))

    @router.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        return serving.detokenize(await parse_body(request, DetokenizeRequest))

    @router.get("/tokenizer_info")
    async def tokenizer_info() -> JSONResponse:
        return serving.tokenizer_info()

