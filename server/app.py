"""The OpenAI-compatible HTTP server's app factory: the engine loop's lifespan (in a thread, or in a process of
its own: ``engine_process``), the request guard, error handlers and the routes.

Build an app for any model the loader knows and drive it in-process (the engine loop starts with the app's
lifespan, so use ``TestClient`` as a context manager)::

    from fastapi.testclient import TestClient
    from rnnserve.server.app import ServerConfig, create_app

    app = create_app(ServerConfig.build(model="lsrl:dictionary", max_num_seqs=4))
    with TestClient(app) as client:
        r = client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 8, "temperature": 0})
        print(r.json()["choices"][0]["text"])

``create_app(config, engine=an_LLMEngine)`` serves an engine built elsewhere (in this process). Routes: ``POST
/v1/completions``, ``POST /v1/chat/completions``, ``/v1/sessions`` (create, get, delete, fork, export and import
a session's state; see docs/api.md), ``GET /v1/models``, ``POST /tokenize``, ``POST
/detokenize``, ``GET /tokenizer_info``, ``GET /health`` (the engine thread is alive), ``GET /ready`` (requests are
taken now: 503 before the lifespan starts the engine thread and while shutting down), ``GET /version``, ``GET
/metrics``, ``GET /dashboard`` (+ ``/dashboard/stats``). With ``api_key`` set, ``/v1/*``, ``/tokenize`` and
``/detokenize`` need ``Authorization: Bearer <key>``; the others
stay open.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response
from starlette.routing import Match, Route
from starlette.types import Receive, Scope, Send

from rnnserve.engine.llm_engine import LLMEngine
from rnnserve.server.async_engine import AsyncEngine
from rnnserve.server.config import ServerConfig, rnnserve_version
from rnnserve.server.dashboard import dashboard_router
from rnnserve.server.engine_core import (
    EngineDriver,
    EngineFactory,
    EngineThread,
    LoopLimits,
    ProcessDriver,
    ThreadDriver,
)
from rnnserve.server.errors import APIError, InternalErrors, bad_request
from rnnserve.server.guard import BodyReads, RequestGuard
from rnnserve.server.metrics import ServerMetrics
from rnnserve.server.routes import OpenAIServing, add_api_routes
from rnnserve.server.sessions import (
    max_state_upload_bytes,
    needs_sweep,
    open_session_store,
    sweep_interval,
    sweep_sessions,
)
from rnnserve.server.streaming import SERVER_SEND

__all__ = ["ServerConfig", "create_app"]


PRIVATE_NETWORK_REQUEST = "access-control-request-private-network"
PRIVATE_NETWORK_ALLOW = "Access-Control-Allow-Private-Network"


class CORS(CORSMiddleware):
    """Starlette's CORS, whose refused preflight (an origin, method or header not allowed) has OpenAI's error body,
    not plain text. A preflight that asks for Private Network Access (Chromium's
    ``Access-Control-Request-Private-Network: true``, on a public page's calls to a loopback or private address)
    is granted with ``Access-Control-Allow-Private-Network: true`` where it is otherwise allowed (an origin the
    operator allowed, a method the routes take). Starlette refused every such preflight: its
    ``allow_private_network`` is off by default, and older versions lack it."""

    def preflight_response(self, request_headers: Headers) -> Response:
        private_network = PRIVATE_NETWORK_REQUEST in request_headers
        if private_network:
            kept = [(k, v) for k, v in request_headers.raw if k.decode("latin-1").lower() != PRIVATE_NETWORK_REQUEST]
            request_headers = Headers(raw=kept)
        response = super().preflight_response(request_headers)
        if response.status_code != 400:
            if private_network:
                response.headers[PRIVATE_NETWORK_ALLOW] = "true"
            return response
        reason = bytes(response.body).decode()
        headers = {k: v for k, v in response.headers.items() if k.lower().startswith("access-control-")}
        return APIError(400, f"{reason} (see --allowed-origins)", code="cors_disallowed", headers=headers).response()


def method_not_allowed(request: Request) -> APIError:
    """The 405 for a method no route of the request's path takes, whose ``Allow`` lists the methods of every route
    of the path (Starlette's named the first route's alone: ``GET`` for ``/v1/sessions/{id}``, which takes
    ``DELETE`` too) and ``HEAD`` with ``GET`` (the guard answers it as a ``GET``)."""
    methods: set[str] = set()
    for route in request.app.router.routes:
        if isinstance(route, Route) and route.methods and route.matches(request.scope)[0] != Match.NONE:
            methods |= route.methods
    if "GET" in methods:
        methods.add("HEAD")
    allow = ", ".join(sorted(methods))
    return APIError(
        405,
        f"method {request.method} is not allowed on {request.url.path} (it takes {allow})",
        code="method_not_allowed",
        headers={"Allow": allow},
    )


class ServerApp(FastAPI):
    """The app, which leaves the server's own ``send`` in each request's scope (:data:`SERVER_SEND`): a stream's
    events go to it past the middlewares' wrappers of ``send`` (see :class:`EventStreamResponse`)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope[SERVER_SEND] = send
        await super().__call__(scope, receive, send)


def engine_driver(
    config: ServerConfig, engine: LLMEngine | None, thread: EngineThread | None, engine_factory: EngineFactory
) -> EngineDriver:
    """The driver of ``engine``, or of ``engine_factory(config.engine)`` in a process of its own or on ``thread``."""
    limits = LoopLimits.of(config)
    if engine is None and thread is None and config.uses_engine_process:
        log_level = logging.getLevelName(config.log_level.upper())
        return ProcessDriver.spawn(config.engine, engine_factory, log_level, limits)
    own_thread = thread is None
    thread = thread or EngineThread()
    try:
        built = engine if engine is not None else thread.call(engine_factory, config.engine)
        return ThreadDriver(built, thread, limits)
    except BaseException:
        if own_thread:
            thread.close()
        raise


def create_app(
    config: ServerConfig,
    engine: LLMEngine | None = None,
    thread: EngineThread | None = None,
    engine_factory: EngineFactory | None = None,
    driver: EngineDriver | None = None,
) -> FastAPI:
    """Build the FastAPI app; raises ``ModelLoadError`` or ``ValueError`` (also for a session folder that
    cannot be used). The engine is ``engine`` when it is given, else ``engine_factory(config.engine)`` (default
    ``LLMEngine.from_config``), built and run in a process of its own when ``config.uses_engine_process``, else
    on ``thread`` (the thread that built ``engine``, or a new one). The engine loop runs with the app's
    lifespan. ``driver``, when given, is the engine's (e.g. one of several API servers' links to one engine
    process)."""
    driver = driver or engine_driver(config, engine, thread, engine_factory or LLMEngine.from_config)
    metrics = ServerMetrics(config.model_names[0], driver.info.max_model_len)
    try:
        sessions = open_session_store(config, driver.info, metrics.sessions) if config.sessions else None
        async_engine = AsyncEngine(driver, metrics, config.max_queued_bytes)
        serving = OpenAIServing(config, async_engine, metrics, sessions)  # raises for a bad chat template
    except BaseException:
        driver.stop(10.0)
        raise

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async_engine.start(asyncio.get_running_loop())
        sweep = None
        if sessions is not None and needs_sweep(sessions):
            interval = sweep_interval(sessions.idle_ttl)
            sweep = asyncio.create_task(sweep_sessions(sessions, interval), name="rnnserve-session-sweep")
        try:
            yield
        finally:
            if sweep is not None:
                sweep.cancel()
            await asyncio.to_thread(async_engine.stop)

    app = ServerApp(title="rnnserve", version=rnnserve_version(), lifespan=lifespan)
    app.state.config = config
    app.state.engine = async_engine
    app.state.metrics = metrics
    app.state.sessions = sessions
    app.state.body_reads = BodyReads()  # the drain's end answers bodies still arriving with a 503
    app.add_middleware(
        RequestGuard,
        api_key=config.api_key,
        max_body_bytes=config.max_body_bytes,
        read_timeout=config.request_read_timeout,
        trusted_hosts=config.trusted_hosts,
        max_state_bytes=max_state_upload_bytes(driver.info.bytes_per_slot, driver.info.max_model_len),
        body_reads=app.state.body_reads,
    )
    if config.allowed_origins:  # outside the guard: a browser's preflight carries no API key
        app.add_middleware(
            CORS,
            allow_origins=config.allowed_origins,
            allow_methods=["GET", "POST", "PUT", "DELETE"],
            # any header (as vLLM): OpenAI's SDKs send their own (X-Stainless-OS, OpenAI-Organization, ...), and a
            # preflight that refused one of them kept every browser client built on them out
            allow_headers=["*"],
        )
    app.add_middleware(InternalErrors)  # added last: the outermost of ours, around the guard

    @app.exception_handler(APIError)
    async def api_error(_: Request, err: APIError) -> JSONResponse:
        return err.response()

    @app.exception_handler(RequestValidationError)
    async def parameter_error(_: Request, err: RequestValidationError) -> JSONResponse:
        """A query or path parameter FastAPI parsed (the dashboard's): OpenAI's 400, not FastAPI's 422."""
        first = err.errors()[0]
        name = ".".join(str(part) for part in first.get("loc", ())[1:]) or None
        return bad_request(f"invalid parameter {name}: {first.get('msg', 'invalid value')}", param=name).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        if err.status_code == 405:
            return method_not_allowed(request).response()
        code = "not_found" if err.status_code == 404 else None
        return APIError(err.status_code, str(err.detail), code=code, headers=err.headers).response()

    add_api_routes(app.router, serving)
    app.include_router(dashboard_router(metrics))
    return app
