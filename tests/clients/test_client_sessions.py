"""The clients' session calls against a live server: create, continue through ``extra_body``, fork, export,
import, delete, and the server's errors as ``openai`` exceptions."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from rnnserve.clients import AsyncClient, Client
from rnnserve.clients.client import SESSION_ID_PATTERN
from rnnserve.server import sessions
from rnnserve.server.app import create_app
from rnnserve.server.background import serve_in_thread
from tests.server.conftest import API_KEY, tiny_config

pytestmark = pytest.mark.timeout(60)

GREEDY = {"temperature": 0, "max_tokens": 4}


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    sessions = tmp_path_factory.mktemp("sessions")
    with serve_in_thread(create_app(tiny_config(api_key=API_KEY, session_dir=str(sessions)))) as base_url:
        yield base_url


def test_sync_client_sessions(url: str) -> None:
    with Client(url, api_key=API_KEY) as client:
        session = client.create_session()
        assert session["object"] == "session" and session["num_tokens"] == 0
        body = client.session_fields(session["id"], ignore_eos=True)
        assert body == {"ignore_eos": True, "session_id": session["id"]}
        first = client.openai.completions.create(model=client.model, prompt="Hi", extra_body=body, **GREEDY)
        assert first.usage is not None and first.usage.prompt_tokens == 2
        assert client.get_session(session["id"])["num_tokens"] == 2 + 4
        fork = client.fork_session(session["id"])
        assert fork["id"] != session["id"] and fork["num_tokens"] == 6
        state = client.export_session(session["id"])
        assert state[8:9] == b"{" and client.import_session(fork["id"], state)["num_tokens"] == 6
        again = client.openai.completions.create(model=client.model, prompt="!", extra_body=body, **GREEDY)
        branch = client.session_fields(fork["id"], ignore_eos=True)
        forked = client.openai.completions.create(model=client.model, prompt="!", extra_body=branch, **GREEDY)
        assert again.choices[0].text == forked.choices[0].text and again.usage.prompt_tokens == 7  # type: ignore[union-attr]
        chat = client.openai.chat.completions.create(
            model=client.model, messages=[{"role": "user", "content": "Yes"}], extra_body=body, **GREEDY
        )
        assert chat.usage is not None and chat.usage.prompt_tokens_details.cached_tokens == 10  # type: ignore[union-attr]
        assert client.delete_session(fork["id"]) == {"id": fork["id"], "object": "session", "deleted": True}
        with pytest.raises(openai.NotFoundError):
            client.get_session(fork["id"])
        with pytest.raises(openai.UnprocessableEntityError):
            client.import_session(fork["id"], b"not a session")
        with pytest.raises(ValueError, match="is not a session id"):
            client.fork_session("sess-too-short")


def test_async_client_sessions(url: str) -> None:
    async def run() -> None:
        async with AsyncClient(url, api_key=API_KEY) as client:
            session = (await client.create_session())["id"]
            body = client.session_fields(session)
            await client.openai.completions.create(model=await client.model(), prompt="Hi", extra_body=body, **GREEDY)
            assert (await client.get_session(session))["num_tokens"] == 6
            fork = (await client.fork_session(session))["id"]
            state = await client.export_session(session)
            assert (await client.import_session(fork, state))["id"] == fork
            assert (await client.delete_session(session))["deleted"]
            with pytest.raises(openai.NotFoundError):
                await client.export_session(session)

    asyncio.run(run())


def test_session_routes_need_the_api_key(url: str) -> None:
    with Client(url, api_key=API_KEY) as client:
        session = client.create_session()["id"]
    for method, path in [
        ("POST", "/v1/sessions"),
        ("GET", f"/v1/sessions/{session}"),
        ("PUT", f"/v1/sessions/{session}/state"),
    ]:
        assert httpx.request(method, url + path, timeout=10).status_code == 401
    with Client(url, api_key="wrong") as client, pytest.raises(openai.AuthenticationError):
        client.export_session(session)


def test_import_of_a_missing_session_creates_it(url: str) -> None:
    with Client(url, api_key=API_KEY) as client:
        session = client.create_session()["id"]
        state = client.export_session(session)
        created = client.import_session("sess-" + "B" * 24, state)
        assert created["id"] == "sess-" + "B" * 24 and client.get_session(created["id"])["num_tokens"] == 0


def test_strings_that_are_no_session_ids_are_refused_before_anything_is_sent(url: str) -> None:
    """An id from elsewhere (``../../metrics``, one with ``?`` or ``/``) is an error, never another route's answer:
    ``get_session("../../version")`` returned the server's version, and percent-encoding did not help, since
    the server decodes ``%2F`` before routing (``get_session(id + "/state")`` returned the state's bytes)."""
    with Client(url, api_key=API_KEY) as client:
        session = client.create_session()["id"]
        for hostile in ("../../version", "../../metrics", "sess-abc?x=1", session + "/state", session + "%2Ffork"):
            with pytest.raises(ValueError, match="is not a session id"):
                client.get_session(hostile)
        assert client.get_session(session)["id"] == session
    assert SESSION_ID_PATTERN.pattern == sessions.SESSION_ID_PATTERN.pattern


def test_the_api_key_comes_from_the_environment_when_not_given(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.setenv("RNNSERVE_API_KEY", API_KEY)
    with Client(url) as client:
        assert client.create_session()["object"] == "session"
    monkeypatch.delenv("RNNSERVE_API_KEY")
    monkeypatch.setenv("OPENAI_API_KEY", API_KEY)
    with Client(url) as client:
        assert client.create_session()["object"] == "session"


def proxy(upstream: str, lose: bytes | None = None) -> tuple[socket.socket, list[bytes]]:
    """A proxy on a free port that sends each request on to ``upstream`` and passes the answer back (one request a
    connection), except the first answer to a request whose line starts with ``lose``: its connection closes
    without it, as a connection lost after the server did the work. Returns the socket and the request lines it
    got, in order."""
    sock = socket.create_server(("127.0.0.1", 0))
    received: list[bytes] = []

    def serve() -> None:
        losing = lose
        with httpx.Client(base_url=upstream, timeout=10) as forward:
            while True:
                try:
                    conn, _ = sock.accept()
                except OSError:  # the test closed the socket
                    return
                with conn:
                    data = b""
                    while b"\r\n\r\n" not in data and (chunk := conn.recv(65536)):
                        data += chunk
                    head, _, body = data.partition(b"\r\n\r\n")
                    line, *fields = head.decode("latin-1").split("\r\n")
                    headers = {k.lower(): v for k, _, v in (f.partition(": ") for f in fields)}
                    while len(body) < int(headers.get("content-length", 0)):
                        body += conn.recv(65536)
                    received.append(line.encode())
                    method, target, _ = line.split(" ")
                    sent = {k: v for k, v in headers.items() if k in ("authorization", "content-type")}
                    answer = forward.request(method, target, headers=sent, content=body)
                    if losing is not None and line.encode().startswith(losing):
                        losing = None
                        continue
                    kept = "".join(f"{k}: {v}\r\n" for k, v in answer.headers.items()
                                   if k in ("content-type", "x-should-retry", "retry-after"))  # fmt: skip
                    conn.sendall(
                        f"HTTP/1.1 {answer.status_code} -\r\n{kept}content-length: {len(answer.content)}\r\n"
                        f"connection: close\r\n\r\n".encode() + answer.content
                    )

    threading.Thread(target=serve, daemon=True).start()
    return sock, received


def test_a_delete_whose_answer_was_lost_is_not_a_404_when_retried(url: str) -> None:
    """openai retries a request whose connection was lost: a delete that the server did, and whose answer was lost,
    was sent again and raised the retry's 404 (``session_not_found``) for the session the call had deleted. A 404
    to the first attempt still raises."""
    with Client(url, api_key=API_KEY) as client:
        session = client.create_session()["id"]
        sock, received = proxy(url, lose=b"DELETE ")
        lossy_url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        with sock, Client(lossy_url, api_key=API_KEY, max_retries=1, timeout=10) as lossy:
            assert lossy.delete_session(session) == {"id": session, "object": "session", "deleted": True}
            assert received == [f"DELETE /v1/sessions/{session} HTTP/1.1".encode()] * 2
            with pytest.raises(openai.NotFoundError):
                client.get_session(session)
            with pytest.raises(openai.NotFoundError):
                lossy.delete_session(session)  # no session, and the first attempt's answer says so
        assert len(received) == 3

        async def run() -> None:
            sock, _ = proxy(url, lose=b"DELETE ")
            again = client.create_session()["id"]
            lossy_url = f"http://127.0.0.1:{sock.getsockname()[1]}"
            async with AsyncClient(lossy_url, api_key=API_KEY, max_retries=1, timeout=10) as lossy:
                with sock:
                    assert (await lossy.delete_session(again))["deleted"]
                    with pytest.raises(openai.NotFoundError):
                        await lossy.delete_session(again)

        asyncio.run(run())


def test_the_session_limit_is_not_retried(tmp_path: Path) -> None:
    """The 429 of ``--max-sessions`` carries ``x-should-retry: false``: openai sent the import twice more, for the
    same answer, after its backoff."""
    app = create_app(tiny_config(session_dir=str(tmp_path), max_sessions=1))
    with serve_in_thread(app) as url, Client(url) as direct:
        state = direct.export_session(direct.create_session()["id"])
        sock, received = proxy(url)
        with sock, Client(f"http://127.0.0.1:{sock.getsockname()[1]}", max_retries=2, timeout=10) as client:
            with pytest.raises(openai.RateLimitError) as err:
                client.import_session("sess-" + "C" * 24, state)
        assert err.value.code == "session_limit_reached" and len(received) == 1
