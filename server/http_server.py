"""The uvicorn server ``rnnserve serve`` runs: uvicorn's httptools (or h11) protocol with a deadline for request
heads, and a shutdown that ends the generations still running at the drain timeout with a 503 instead of cutting
them."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import signal
import socket
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING

import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import H11Protocol

from rnnserve.server.async_engine import AsyncEngine
from rnnserve.server.config import ServerConfig
from rnnserve.server.engine_core import SHUTDOWN_MESSAGE
from rnnserve.server.errors import APIError
from rnnserve.server.guard import BodyReads

if TYPE_CHECKING:
    from uvicorn.protocols.http.h11_impl import RequestResponseCycle as H11Cycle
    from uvicorn.protocols.http.httptools_impl import RequestResponseCycle as HttpToolsCycle

MAX_HEAD_BYTES = 16 * 1024  # a request line and headers; h11's default limit, applied to httptools as well
DRAIN_GRACE_SECONDS = 5.0  # after failing the last generations, how long their responses may take to finish
LINGER_SECONDS = 2.0  # after an error that ends a connection, how long what the client still sends is read and dropped


def raw_error_response(error: APIError, reason: str) -> bytes:
    """``error`` as a whole HTTP/1.1 response that closes the connection, for use outside any request."""
    body = json.dumps(error.body()).encode()
    head = (
        f"HTTP/1.1 {error.status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


class HeadDeadline(asyncio.Protocol):
    """Added to one of uvicorn's HTTP/1.1 protocols: a connection that has not sent a whole request head within
    ``read_timeout`` seconds of opening (or of its last response) is closed, with a 408 if it sent part of one.
    (uvicorn alone keeps such connections forever; the request body's deadline is the app's ``RequestGuard``.)"""

    read_timeout = 30.0
    _head_deadline: asyncio.TimerHandle | None = None
    _lingering: asyncio.TimerHandle | None = None
    # uvicorn's protocols have these:
    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport
    cycle: H11Cycle | HttpToolsCycle | None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # type: ignore[misc]
        self._arm_head_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        for timer in (self._head_deadline, self._lingering):
            if timer is not None:
                timer.cancel()

    def data_received(self, data: bytes) -> None:
        if self._lingering is None:  # after an answer that ends the connection, input is dropped
            super().data_received(data)  # type: ignore[misc]

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a request it cannot parse (or a head too large): a 400 in OpenAI's error format,
        then a lingering close."""
        self.answer_and_close(raw_error_response(APIError(400, msg, code="invalid_http_request"), "Bad Request"))

    def answer_and_close(self, response: bytes) -> None:
        """Send ``response``, then the end of the stream, and read and drop what the client still sends until it
        closes or ``LINGER_SECONDS`` pass. Closing at once with the client's bytes unread would make the kernel
        reset the connection, which can destroy the answer before the client has read it."""
        if self.transport.is_closing() or self._lingering is not None:
            return
        self.transport.write(response)
        if not self.transport.can_write_eof():
            self.transport.close()
            return
        self.transport.write_eof()
        self._lingering = self.loop.call_later(LINGER_SECONDS, self.transport.close)

    def partial_head(self) -> bool:
        """Whether part of a request head has arrived (and not the rest)."""
        raise NotImplementedError

    def _arm_head_deadline(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
        self._head_deadline = self.loop.call_later(self.read_timeout, self._head_timed_out, self.cycle)

    def _head_timed_out(self, cycle: H11Cycle | HttpToolsCycle | None) -> None:
        """Close the connection if no request has started since ``cycle`` (the one current when armed) ended."""
        started = self.cycle is not cycle or (cycle is not None and not cycle.response_complete)
        if started or self.transport.is_closing() or self._lingering is not None:
            return
        if self.partial_head():
            message = f"the request head did not arrive within {self.read_timeout:g} s"
            error = APIError(408, message, code="request_timeout", retryable=True)
            self.answer_and_close(raw_error_response(error, "Request Timeout"))
        else:
            self.transport.close()


class H11HeadDeadline(HeadDeadline, H11Protocol):
    """uvicorn's pure-Python h11 protocol with the head deadline."""

    def partial_head(self) -> bool:
        return bool(self.conn.trailing_data[0])


def httptools_protocol() -> type[HeadDeadline] | None:
    """uvicorn's httptools protocol with the head deadline; None without the ``httptools`` package."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:
        return None

    class HttpToolsHeadDeadline(HeadDeadline, HttpToolsProtocol):
        """uvicorn's httptools (C parser) protocol with the head deadline: a head has begun between the
        parser's message-begin and headers-complete callbacks."""

        _head_begun = False
        _awaiting_head = True
        _head_bytes = 0

        def data_received(self, data: bytes) -> None:
            """Feed the parser; a head past MAX_HEAD_BYTES gets a 400 and the connection closes (h11 has this
            limit built in; httptools would buffer a head of any size)."""
            if self._awaiting_head:
                self._head_bytes += len(data)
            super().data_received(data)
            if self._awaiting_head and self._head_bytes > MAX_HEAD_BYTES:
                self.send_400_response("Request head too large.")

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._head_begun = True

        def on_headers_complete(self) -> None:
            self._head_begun = self._awaiting_head = False
            self._head_bytes = 0
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self._awaiting_head = True

        def partial_head(self) -> bool:
            return self._head_begun

    return HttpToolsHeadDeadline


def http_protocol(implementation: str, read_timeout: float) -> type[HeadDeadline]:
    """The protocol class uvicorn instantiates per connection: ``implementation`` (auto, httptools or h11) with
    a head deadline of ``read_timeout`` seconds; h11 when httptools is not installed (the config checks that
    an explicit httptools is)."""
    fast = None if implementation == "h11" else httptools_protocol()
    base = fast or H11HeadDeadline
    return type(base.__name__, (base,), {"read_timeout": read_timeout})


def http_stack(implementation: str) -> str:
    """What :func:`build_server` runs for ``implementation``: the protocol and the event loop, e.g.
    ``httptools+uvloop`` (uvicorn takes uvloop when it is installed)."""
    protocol = "h11" if issubclass(http_protocol(implementation, 1.0), H11Protocol) else "httptools"
    return f"{protocol}+{'uvloop' if importlib.util.find_spec('uvloop') else 'asyncio'}"


class DrainingServer(uvicorn.Server):
    """On SIGTERM/SIGINT uvicorn stops accepting connections and waits for the open ones; when
    ``drain_timeout`` ends (or a second SIGINT comes), this fails the generations still running, so streams end
    with an error event and ``[DONE]`` and other requests get a JSON 503, and answers requests whose bodies are
    still arriving with a 503 (``body_reads``), rather than uvicorn cancelling their tasks mid-response or with a
    500. With
    ``heartbeat``, the event loop calls it every ``heartbeat_seconds`` from startup on, draining included (a
    supervisor so sees that the loop runs)."""

    def __init__(
        self,
        config: uvicorn.Config,
        engine: AsyncEngine,
        drain_timeout: float,
        body_reads: BodyReads | None = None,
        heartbeat: Callable[[], None] | None = None,
        heartbeat_seconds: float = 1.0,
    ) -> None:
        super().__init__(config)
        self.engine = engine
        self.drain_timeout = drain_timeout
        self.body_reads = body_reads or BodyReads()
        self.heartbeat = heartbeat
        self.heartbeat_seconds = heartbeat_seconds
        self._loop: asyncio.AbstractEventLoop | None = None  # the event loop, once draining
        self._drain_ended = False

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if sockets is not None and self.started:  # uvicorn says "Uvicorn running on ..." only for its own sockets
            self._log_started_message(sockets)
        if self.heartbeat is not None:
            self._beat()

    def _beat(self) -> None:
        self.heartbeat()  # type: ignore[misc]
        asyncio.get_running_loop().call_later(self.heartbeat_seconds, self._beat)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.engine.draining = True  # /ready answers 503 from now on
        loop = asyncio.get_running_loop()
        self._loop = loop
        deadline = loop.call_later(self.drain_timeout, self.end_drain)
        try:
            await super().shutdown(sockets)
        finally:
            deadline.cancel()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """uvicorn's signal handler, except that a second Ctrl-C (SIGINT) while draining ends the drain at once, as
        its timeout would (streams end with their 503 error event and ``[DONE]``); only a third forces the exit,
        cutting what is left. (uvicorn forced it at the second: every stream was cut mid-chunk, and each left an
        error in the log.) A second SIGTERM changes nothing, as with uvicorn."""
        if sig == signal.SIGINT and self.should_exit and not self._drain_ended and self._loop is not None:
            self._drain_ended = True
            self._loop.call_soon_threadsafe(self.end_drain)  # a signal handler may run inside any callback
            return
        super().handle_exit(sig, frame)

    def end_drain(self) -> None:
        """The drain timeout passed (or a second Ctrl-C came): generations still running fail, and bodies still
        arriving get a 503."""
        self._drain_ended = True
        self.engine.fail_in_flight(SHUTDOWN_MESSAGE)
        self.body_reads.refuse()


def listen_socket(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    """A socket bound to ``host:port``, to hand to :meth:`DrainingServer.run` (which starts listening on it).
    Binding before the model loads finds a busy port at once; until the server runs, connections are refused.
    With ``reuse_port`` several sockets of this user may bind the port (``SO_REUSEPORT``): the kernel spreads
    new connections evenly over those that listen. Raises OSError (e.g. the address is in use)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP by name: asyncio sets TCP_NODELAY only on sockets whose proto says TCP, and without it every
    # response on a kept-alive connection waits ~40 ms (Nagle's algorithm against the client's delayed ACK).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: no wait after a restart
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def build_server(
    app: FastAPI, config: ServerConfig, heartbeat: Callable[[], None] | None = None, heartbeat_seconds: float = 1.0
) -> DrainingServer:
    """The uvicorn server for ``app`` (made by ``create_app(config)``) with the config's connection limits (and
    ``heartbeat``, see :class:`DrainingServer`)."""
    uvicorn_config = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        http=http_protocol(config.http, config.request_read_timeout),
        log_level=config.log_level,
        timeout_keep_alive=config.keep_alive_timeout,  # type: ignore[arg-type]
        limit_concurrency=config.limit_concurrency,
        timeout_graceful_shutdown=config.drain_timeout + DRAIN_GRACE_SECONDS,  # type: ignore[arg-type]
        access_log=config.access_log,
    )
    return DrainingServer(
        uvicorn_config, app.state.engine, config.drain_timeout, app.state.body_reads, heartbeat, heartbeat_seconds
    )
