"""The Python clients against a live server: the official openai client underneath, the extra routes, and
retries that honour Retry-After."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
import time

import openai
import pytest

from rnnserve.clients import AsyncClient, Client
from rnnserve.engine.scheduler import QueueFullError
from rnnserve.server.app import create_app
from rnnserve.server.background import serve_in_thread
from tests.server.conftest import API_KEY, TINY, tiny_config

pytestmark = pytest.mark.timeout(60)

GREEDY = {"temperature": 0, "max_tokens": 6}
MESSAGES = [{"role": "user", "content": "Hi"}]


def test_sync_client_routes(live_url: str) -> None:
    with Client(live_url + "/v1", api_key=API_KEY) as client:
        assert client.health() and client.ready() and client.model == TINY
        assert client.version() and "rnnserve_generation_tokens_total" in client.metrics()
        completion = client.openai.completions.create(
            model=client.model, prompt="Hello", extra_body={"top_k": 1, "ignore_eos": True}, **GREEDY
        )
        assert completion.usage is not None and completion.usage.completion_tokens == 6
        chat = client.openai.chat.completions.create(model=client.model, messages=MESSAGES, **GREEDY)
        assert chat.choices[0].message.role == "assistant"
        assert client.detokenize(client.tokenize("héllo")) == "héllo"
        assert client.tokenize("ab", model=TINY) == [97, 98]


def test_sync_client_errors(live_url: str) -> None:
    with Client(live_url, api_key=API_KEY) as client:
        with pytest.raises(openai.BadRequestError) as err:
            client.detokenize([10**9])
        assert err.value.body["param"] == "tokens"  # type: ignore[index]
        with pytest.raises(openai.NotFoundError):
            client.tokenize("a", model="gpt-17")
    with Client(live_url, api_key="wrong") as client:
        with pytest.raises(openai.AuthenticationError):
            client.tokenize("a")
        assert client.health()  # open without the key
    assert not Client("http://127.0.0.1:9", max_retries=0).health()  # nothing listens there


def test_async_client_routes(live_url: str) -> None:
    async def scenario() -> None:
        async with AsyncClient(live_url, api_key=API_KEY) as client:
            assert await client.health() and await client.ready() and await client.model() == TINY
            stream = await client.openai.completions.create(model=TINY, prompt="Hello", stream=True, **GREEDY)
            text = "".join([c.choices[0].text async for c in stream if c.choices])
            assert await client.tokenize("ab") == [97, 98] and await client.detokenize([97, 98]) == "ab"
            assert len(text) > 0 and await client.version() == Client(live_url).version()
            assert "process_resident_memory_bytes" in await client.metrics()

    asyncio.run(scenario())


def test_a_busy_server_is_retried_after_its_retry_after(monkeypatch: pytest.MonkeyPatch) -> None:
    app = create_app(tiny_config(retry_after_seconds=1))
    engine = app.state.engine.engine
    real_add = engine.add_request
    attempts: list[float] = []

    def add_request(*args, **kwargs):  # type: ignore[no-untyped-def]
        attempts.append(time.monotonic())
        if len(attempts) == 1:
            raise QueueFullError("256 requests are waiting")
        return real_add(*args, **kwargs)

    monkeypatch.setattr(engine, "add_request", add_request)
    with serve_in_thread(app) as url, Client(url, max_retries=1) as client:
        completion = client.openai.completions.create(model=TINY, prompt="Hello", **GREEDY)
    assert completion.choices[0].finish_reason == "length" and len(attempts) == 2
    assert attempts[1] - attempts[0] >= 0.95  # Retry-After: 1, not openai's own 0.5 s first backoff


def stream_then(ending: bytes) -> tuple[socket.socket, threading.Thread]:
    """A one-shot HTTP server on a free port that answers a POST with a chunked event stream of one chunk, then
    ``ending`` (raw bytes, the chunked framing included, or nothing) and closes the connection."""
    sock = socket.create_server(("127.0.0.1", 0))
    first = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": TINY,
             "choices": [{"index": 0, "text": "a", "finish_reason": None, "logprobs": None}]}  # fmt: skip

    def answer() -> None:
        conn, _ = sock.accept()
        with conn:
            received = b""
            while b"\r\n\r\n" not in received:
                received += conn.recv(65536)
            head, _, body = received.partition(b"\r\n\r\n")
            length = int(re.search(rb"content-length: *(\d+)", head, re.I).group(1))  # type: ignore[union-attr]
            while len(body) < length:
                body += conn.recv(65536)
            event = b"data: " + json.dumps(first).encode() + b"\n\n"
            conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                         + b"%x\r\n%s\r\n" % (len(event), event) + ending)  # fmt: skip

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    return sock, thread


def chunked(*events: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events) + b"0\r\n\r\n"


@pytest.mark.parametrize(
    ("ending", "error"),
    [
        pytest.param(b"", openai.APIConnectionError, id="connection-cut"),
        pytest.param(chunked(b'data: {"error": {"message": "generation failed: boom", "type": "internal_error", '
                             b'"param": null, "code": null}}\n\n', b"data: [DONE]\n\n"), openai.APIError,
                     id="error-event"),
    ],
)  # fmt: skip
def test_a_stream_cut_or_ended_by_an_error_event_raises_as_the_client_documents(
    ending: bytes, error: type[Exception]
) -> None:
    sock, thread = stream_then(ending)
    with sock, Client(f"http://127.0.0.1:{sock.getsockname()[1]}", max_retries=0, timeout=10) as client:
        texts = []
        with pytest.raises(error) as raised:
            for chunk in client.openai.completions.create(model=TINY, prompt="x", stream=True):
                texts.append(chunk.choices[0].text)
        assert texts == ["a"]  # the chunk before the end arrived
        if error is openai.APIError:
            assert "generation failed: boom" in str(raised.value)
        thread.join(10)


def hang_up_server() -> tuple[socket.socket, list[bytes]]:
    """A server on a free port that reads each request and closes the connection without an answer (a server
    that dies, or a connection lost, after the request arrived); the request lines it got, in order."""
    sock = socket.create_server(("127.0.0.1", 0))
    received: list[bytes] = []

    def serve() -> None:
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:  # the test closed the socket
                return
            with conn:
                data = b""
                while b"\r\n\r\n" not in data:
                    data += conn.recv(65536)
                received.append(data.split(b"\r\n", 1)[0])

    threading.Thread(target=serve, daemon=True).start()
    return sock, received


def test_session_turns_and_session_creation_are_sent_once() -> None:
    """openai retries a lost connection or a timeout: a session turn that the server stored while its client
    lost the answer was sent again and entered the session twice; a create or fork made a second session."""
    sock, received = hang_up_server()
    session = "sess-" + "A" * 24
    with sock, Client(f"http://127.0.0.1:{sock.getsockname()[1]}", max_retries=1, timeout=10) as client:
        calls = {
            "turn": lambda: client.openai.completions.create(
                model=TINY, prompt="x", max_tokens=2, extra_body=client.session_fields(session)
            ),
            "chat turn": lambda: client.openai.chat.completions.create(
                model=TINY, messages=MESSAGES, extra_body=client.session_fields(session)
            ),
            "create": client.create_session,
            "fork": lambda: client.fork_session(session),
        }
        for name, call in calls.items():
            received.clear()
            with pytest.raises(openai.APIConnectionError):
                call()
            assert len(received) == 1, name
        received.clear()
        with pytest.raises(openai.APIConnectionError):
            client.openai.completions.create(model=TINY, prompt="x", max_tokens=2)
        assert received == [b"POST /v1/completions HTTP/1.1"] * 2  # other requests keep openai's retries

    async def scenario() -> None:
        sock, received = hang_up_server()
        async with AsyncClient(f"http://127.0.0.1:{sock.getsockname()[1]}", max_retries=1, timeout=10) as client:
            for call in (
                lambda: client.openai.completions.create(model=TINY, prompt="x", extra_body={"session_id": session}),
                client.create_session,
                lambda: client.fork_session(session),
            ):
                received.clear()
                with pytest.raises(openai.APIConnectionError):
                    await call()
                assert len(received) == 1
        sock.close()

    asyncio.run(scenario())
