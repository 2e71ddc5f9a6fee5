"""The socket ``rnnserve serve`` listens on (connections it accepts send small writes at once) and the HTTP
protocol it picks."""

from __future__ import annotations

import asyncio
import importlib.util
import socket

import pytest
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from rnnserve.server import http_server
from rnnserve.server.config import ServerConfig
from rnnserve.server.errors import APIError
from rnnserve.server.guard import BodyReads
from rnnserve.server.http_server import http_protocol, http_stack, listen_socket


def test_accepted_connections_disable_nagle() -> None:
    """asyncio turns on TCP_NODELAY only for sockets whose protocol says TCP; a socket made with protocol 0
    would leave every streamed chunk and response body to Nagle's algorithm."""

    async def nodelay_of_accepted_connection() -> int:
        loop = asyncio.get_running_loop()
        accepted: asyncio.Future[int] = loop.create_future()

        class Accept(asyncio.Protocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:  # type: ignore[override]
                sock = transport.get_extra_info("socket")
                accepted.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))

        sock = listen_socket("127.0.0.1", 0)
        server = await loop.create_server(Accept, sock=sock)
        try:
            _, writer = await asyncio.open_connection(*sock.getsockname())
            result = await asyncio.wait_for(accepted, 10)
            writer.close()
            return result
        finally:
            server.close()

    assert asyncio.run(nodelay_of_accepted_connection()) == 1


def test_http_protocol_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    auto = http_protocol("auto", 5.0)
    assert issubclass(auto, HttpToolsProtocol) and auto.read_timeout == 5.0
    assert issubclass(http_protocol("httptools", 1.0), HttpToolsProtocol)
    h11 = http_protocol("h11", 2.0)
    assert issubclass(h11, H11Protocol) and not issubclass(h11, HttpToolsProtocol) and h11.read_timeout == 2.0
    assert http_stack("auto") == "httptools+uvloop" and http_stack("h11") == "h11+uvloop"  # both are dependencies
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "httptools" else real_find_spec(name))
    with pytest.raises(ValueError, match="httptools"):
        ServerConfig.build(model="random:mingru-tiny", http="httptools")
    monkeypatch.setattr(http_server, "httptools_protocol", lambda: None)
    assert http_stack("auto") == "h11+uvloop"  # auto falls back to h11
    assert ServerConfig.build(model="random:mingru-tiny", http="auto").http == "auto"


def test_body_reads_end_with_a_503_when_refused_and_a_cancelled_request_stays_cancelled() -> None:
    """The drain's end (``BodyReads.refuse``) answers the bodies still arriving, and any read after, with a 503;
    a request cancelled before (a client gone, uvicorn's own cancel) still ends cancelled."""

    async def scenario() -> None:
        reads = BodyReads()
        never = asyncio.Event()

        async def body() -> bytes:
            await never.wait()
            return b""

        pending = asyncio.ensure_future(reads.read(body(), 60))
        cancelled = asyncio.ensure_future(reads.read(body(), 60))
        await asyncio.sleep(0)
        cancelled.cancel()
        await asyncio.sleep(0)
        reads.refuse()
        for read in (pending, reads.read(body(), 60)):
            with pytest.raises(APIError) as refusal:
                await read
            assert refusal.value.status == 503 and refusal.value.type == "service_unavailable"
        assert cancelled.cancelled()

    asyncio.run(scenario())
