"""How a response ends when its client goes away, called through ASGI as a server calls it: a disconnect before
the first token, a send that raises (ASGI 2.4 servers say a closed connection that way) and a non-streamed
request's disconnect. Each request asks for more tokens than it could make in the test's time: it ends only
because the server noticed, and its state slot is free again."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from fastapi import FastAPI

from rnnserve.server.app import create_app
from tests.server.conftest import tiny_config

pytestmark = pytest.mark.timeout(120)

LONG = {"prompt": "Hello", "max_tokens": 100_000, "ignore_eos": True}
Receive = Callable[[], Awaitable[dict]]


def scope(body: bytes, spec_version: str = "2.3") -> dict[str, Any]:
    headers = [(b"host", b"127.0.0.1"), (b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())]  # fmt: skip
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": spec_version}, "http_version": "1.1",
            "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
            "query_string": b"", "root_path": "", "headers": headers, "client": ("127.0.0.1", 40000),
            "server": ("127.0.0.1", 8000), "state": {}}  # fmt: skip


def receiving(body: bytes, disconnected: asyncio.Event) -> Receive:
    """The request's body, then ``http.disconnect`` once ``disconnected`` is set."""
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict:
        if messages:
            return messages.pop()
        await disconnected.wait()
        return {"type": "http.disconnect"}

    return receive


async def run_with_app(test: Callable[[FastAPI], Awaitable[None]], middleware: type | None = None) -> None:
    """``test(app)`` with the app's lifespan (its engine loop) running, ``middleware`` added to the app first;
    afterwards no request is unfinished."""
    app = create_app(tiny_config())
    if middleware is not None:
        app.add_middleware(middleware)
    lifespan: asyncio.Queue = asyncio.Queue()
    started = asyncio.Event()

    async def send(message: dict) -> None:
        if message["type"] == "lifespan.startup.complete":
            started.set()

    await lifespan.put({"type": "lifespan.startup"})
    task = asyncio.ensure_future(app({"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}, lifespan.get, send))
    await started.wait()
    try:
        await test(app)
        engine = app.state.engine.engine
        for _ in range(200):  # the abort reaches the engine loop before its next step
            if not engine.has_unfinished_requests():
                break
            await asyncio.sleep(0.05)
        assert not engine.has_unfinished_requests()
        assert app.state.engine._consumers == {}
    finally:
        await lifespan.put({"type": "lifespan.shutdown"})
        await task


def test_a_stream_whose_client_left_before_its_first_token_ends_and_frees_its_slot(
    caplog: pytest.LogCaptureFixture,
) -> None:
    body = json.dumps({**LONG, "stream": True}).encode()
    sent: list[dict] = []

    async def test(app: FastAPI) -> None:
        disconnected = asyncio.Event()
        disconnected.set()

        async def send(message: dict) -> None:
            sent.append(message)

        await asyncio.wait_for(app(scope(body), receiving(body, disconnected), send), 30)

    asyncio.run(run_with_app(test))
    assert sent[0]["status"] == 200 and all(m["more_body"] for m in sent[1:-1])
    assert sent[-1]["more_body"] is False and sent[-1]["body"].endswith(b"data: [DONE]\n\n")  # one write: the end
    text = b"".join(m.get("body", b"") for m in sent[1:]).decode()
    assert text.endswith("data: [DONE]\n\n") and '"code": "client_disconnected"' in text
    assert "generation failed" not in caplog.text  # a disconnect is no server error


def test_a_streams_events_are_sent_from_a_task_of_their_own() -> None:
    """A token's event is sent from a task whose coroutines are the response's few, not from the request's task,
    which would resume every middleware of the app on each token."""
    body = json.dumps({"prompt": "Hello", "max_tokens": 8, "ignore_eos": True, "stream": True}).encode()
    senders: list[asyncio.Task | None] = []

    async def test(app: FastAPI) -> None:
        async def send(message: dict) -> None:
            senders.append(asyncio.current_task())

        request = asyncio.ensure_future(app(scope(body), receiving(body, asyncio.Event()), send))
        await asyncio.wait_for(request, 30)
        assert senders[0] is request  # the response's start
        assert len(senders) > 2 and all(task is not request for task in senders[1:])

    asyncio.run(run_with_app(test))


def test_a_streams_body_goes_to_the_servers_send_past_the_middlewares_wrappers() -> None:
    """The response's start goes through the app's middlewares (Starlette's wrap ``send`` to see it); the events
    go to the server's own ``send``: a wrapper of ``send`` in the app sees the start alone."""
    body = json.dumps({"prompt": "Hello", "max_tokens": 8, "ignore_eos": True, "stream": True}).encode()
    wrapped: list[str] = []
    sent: list[dict] = []

    class WatchSends:
        def __init__(self, app: Any) -> None:
            self.app = app

        async def __call__(self, scope: dict, receive: Receive, send: Callable[[dict], Awaitable[None]]) -> None:
            async def watched(message: dict) -> None:
                if scope["type"] == "http":
                    wrapped.append(message["type"])
                await send(message)

            await self.app(scope, receive, watched)

    async def test(app: FastAPI) -> None:
        async def send(message: dict) -> None:
            sent.append(message)

        await asyncio.wait_for(app(scope(body), receiving(body, asyncio.Event()), send), 30)

    asyncio.run(run_with_app(test, WatchSends))
    assert wrapped == ["http.response.start"]
    assert len(sent) > 2 and sent[-1]["body"].endswith(b"data: [DONE]\n\n") and sent[-1]["more_body"] is False


def test_a_stream_whose_send_raises_ends_quietly_and_frees_its_slot() -> None:
    body = json.dumps({**LONG, "stream": True}).encode()
    bodies: list[bytes] = []

    async def test(app: FastAPI) -> None:
        async def send(message: dict) -> None:
            if message["type"] == "http.response.body":
                if len(bodies) == 3:
                    raise OSError("the connection is closed")
                bodies.append(message["body"])

        await asyncio.wait_for(app(scope(body, "2.4"), receiving(body, asyncio.Event()), send), 30)

    asyncio.run(run_with_app(test))
    assert len(bodies) == 3 and all(b.startswith(b"data: {") for b in bodies)


def test_a_stream_whose_receive_raises_ends_as_after_a_disconnect(caplog: pytest.LogCaptureFixture) -> None:
    body = json.dumps({**LONG, "stream": True}).encode()
    sent: list[dict] = []
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def test(app: FastAPI) -> None:
        async def receive() -> dict:
            if messages:
                return messages.pop()
            await asyncio.sleep(0.2)
            raise RuntimeError("the transport is gone")

        async def send(message: dict) -> None:
            sent.append(message)

        await asyncio.wait_for(app(scope(body), receive, send), 30)

    asyncio.run(run_with_app(test))
    text = b"".join(m.get("body", b"") for m in sent[1:]).decode()
    assert text.endswith("data: [DONE]\n\n") and '"code": "client_disconnected"' in text
    assert "never retrieved" not in caplog.text and "generation failed" not in caplog.text


def test_a_non_streamed_request_whose_client_left_ends_and_frees_its_slot(caplog: pytest.LogCaptureFixture) -> None:
    body = json.dumps(LONG).encode()
    sent: list[dict] = []

    async def test(app: FastAPI) -> None:
        disconnected = asyncio.Event()

        async def send(message: dict) -> None:
            sent.append(message)

        call = asyncio.ensure_future(app(scope(body), receiving(body, disconnected), send))
        await asyncio.sleep(0.5)
        assert not call.done() and app.state.engine.engine.has_unfinished_requests()
        disconnected.set()
        await asyncio.wait_for(call, 30)

    asyncio.run(run_with_app(test))
    assert sent[0]["status"] == 499
    assert json.loads(sent[1]["body"])["error"]["code"] == "client_disconnected"
    assert "generation failed" not in caplog.text
