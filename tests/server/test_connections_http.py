"""Against a real ``rnnserve serve``, on each HTTP implementation (httptools, h11): slow and stalled clients are cut
off by the read timeout while others are served, request heads and queued prompts are bounded in bytes, kept-alive
connections answer at once (TCP_NODELAY), a client that half-closes after its request is taken for gone, and the guard's
Host / Content-Type / API-key-file checks."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn
from fastapi import FastAPI

from rnnserve.server.http_server import http_protocol, listen_socket
from tests.server.conftest import TINY
from tests.server.server_process import ServerProcess, running_server

pytestmark = pytest.mark.timeout(90)
READ_TIMEOUT = 3.0
KEY = "key-from-a-file"
AUTH = {"Authorization": f"Bearer {KEY}"}
HEAD = (
    "POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
    f"Authorization: Bearer {KEY}\r\n"
)
STALLED = {
    "body": (HEAD + "Content-Length: 100\r\n\r\n{").encode(),  # declares a body, sends one byte of it
    "head": HEAD.encode(),  # never finishes its headers
    "idle": b"",  # connects and says nothing
}


@pytest.fixture(scope="module", params=["httptools", "h11"])
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    key_file = tmp_path_factory.mktemp("secret") / "key"
    key_file.write_text(KEY + "\n")
    flags = ["--model", TINY, "--max-num-seqs", "1", "--request-read-timeout", str(READ_TIMEOUT),
             "--keep-alive-timeout", "1", "--max-queued-bytes", "1000", "--api-key-file", str(key_file),
             "--http", request.param]  # fmt: skip
    with running_server(*flags, env={"RNNSERVE_API_KEY": ""}) as process:
        yield process


def read_until_closed(sock: socket.socket, deadline: float) -> bytes:
    """Everything the server sends until it closes the connection; socket.timeout past ``deadline``."""
    data = b""
    while True:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        chunk = sock.recv(65536)
        if not chunk:
            return data
        data += chunk


def test_stalled_clients_are_cut_off_while_others_are_served(server: ServerProcess) -> None:
    kinds = ["body"] * 120 + ["head"] * 40 + ["idle"] * 40
    sockets = []
    for kind in kinds:
        sock = socket.create_connection(("127.0.0.1", server.port))
        sock.sendall(STALLED[kind])
        sockets.append(sock)
    opened = time.monotonic()
    try:
        body = {"prompt": "Hi", "max_tokens": 2}
        ok = httpx.post(f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=30)
        assert ok.status_code == 200 and time.monotonic() - opened < READ_TIMEOUT  # served while the others stall
        deadline = opened + READ_TIMEOUT + 15
        answers = [read_until_closed(sock, deadline) for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()
    for kind, answer in zip(kinds, answers, strict=True):
        if kind == "idle":
            assert answer == b""
            continue
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408"), (kind, answer)
        assert json.loads(body)["error"]["code"] == "request_timeout"

    with socket.create_connection(("127.0.0.1", server.port)) as sock:  # an idle keep-alive connection
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
        assert read_until_closed(sock, time.monotonic() + 15).startswith(b"HTTP/1.1 200")


def test_queued_prompt_bytes_are_bounded(server: ServerProcess) -> None:
    url = f"{server.url}/v1/completions"
    long = {"prompt": "Hello", "max_tokens": 8000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url, json=long, headers=AUTH, timeout=30) as running:  # holds the only slot
        lines = running.iter_lines()  # kept: closing this iterator would close the response
        assert next(lines).startswith("data: ")
        waiting = {"prompt": "a" * 600, "max_tokens": 1, "stream": True}
        with httpx.stream("POST", url, json=waiting, headers=AUTH, timeout=30) as queued:
            assert queued.status_code == 200  # accepted: 600 bytes now wait for the slot
            refused = httpx.post(url, json={"prompt": "b" * 600, "max_tokens": 1}, headers=AUTH, timeout=30)
    assert refused.status_code == 429 and refused.headers["Retry-After"] == "1"
    assert refused.json()["error"]["code"] == "queue_full"
    again = httpx.post(url, json={"prompt": "b" * 600, "max_tokens": 1}, headers=AUTH, timeout=30)
    assert again.status_code == 200  # the aborted requests gave their bytes back


def test_a_non_streamed_request_stops_counting_as_queued_at_its_first_token(server: ServerProcess) -> None:
    """A non-streamed request has no output until it ends; its prompt counted as queued through its whole decode,
    so a decoding 600-byte request had the next 600-byte request refused with nothing waiting."""
    body = json.dumps({"prompt": "a" * 600, "max_tokens": 8000, "ignore_eos": True})
    head = HEAD + f"Content-Length: {len(body)}\r\n\r\n"
    with socket.create_connection(("127.0.0.1", server.port)) as sock:  # holds the only slot, decoding
        before = generated_tokens(server)
        sock.sendall((head + body).encode())
        deadline = time.monotonic() + 30
        while generated_tokens(server) < before + 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        next_one = {"prompt": "b" * 600, "max_tokens": 1, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=next_one, headers=AUTH, timeout=30) as queued:
            assert queued.status_code == 200


def generated_tokens(server: ServerProcess) -> float:
    text = httpx.get(f"{server.url}/metrics", headers=AUTH, timeout=10).text
    lines = [line for line in text.splitlines() if line.startswith("rnnserve_generation_tokens_total")]
    return sum(float(line.split()[-1]) for line in lines)


def test_guard_on_a_real_socket(server: ServerProcess) -> None:
    body = json.dumps({"prompt": "Hi", "max_tokens": 1})
    form = httpx.post(f"{server.url}/v1/completions", content=body, headers={**AUTH, "Content-Type": "text/plain"})
    assert form.status_code == 415 and form.json()["error"]["code"] == "unsupported_media_type"
    rebound = httpx.get(f"{server.url}/v1/models", headers={**AUTH, "Host": "attacker.example"})
    assert rebound.status_code == 400 and rebound.json()["error"]["code"] == "invalid_host"
    assert httpx.get(f"{server.url}/v1/models").status_code == 401
    [card] = httpx.get(f"{server.url}/v1/models", headers=AUTH).json()["data"]
    assert card["id"] == card["root"] == TINY
    assert KEY.encode() not in Path(f"/proc/{server.proc.pid}/cmdline").read_bytes()
    assert "--api-key is visible" not in server.output


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_kept_alive_connections_answer_without_nagle_delay(loop: str) -> None:
    """A response's head and body are separate writes: without TCP_NODELAY on the server's side, the body of each
    response after the first on a connection waits for the client's delayed ACK (40 ms or more on Linux). The
    accepted connections of a socket from ``listen_socket`` have it, on either event loop (asyncio sets it only
    on sockets made with IPPROTO_TCP; uvloop on every TCP socket). Read from the server's own sockets, not timed."""
    app = FastAPI()

    @app.get("/ping")
    async def ping() -> dict[str, bool]:
        return {"pong": True}

    sock = listen_socket("127.0.0.1", 0)
    config = uvicorn.Config(app, http=http_protocol("auto", READ_TIMEOUT), loop=loop, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline
            time.sleep(0.01)
        with httpx.Client(base_url=f"http://127.0.0.1:{sock.getsockname()[1]}") as client:
            assert client.get("/ping").status_code == client.get("/ping").status_code == 200
            [connection] = server.server_state.connections
            accepted = connection.transport.get_extra_info("socket")  # type: ignore[attr-defined]
            assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def test_a_client_that_half_closes_after_its_request_is_taken_for_gone(server: ServerProcess) -> None:
    """A client that shuts down its sending side after its request (``nc -N``, some HTTP/1.0 clients) gets no
    answer: its FIN cannot be told from a client that closed its socket and left, and answering it would keep
    every request of a client that left (queued, or not streamed: nothing is written to find out) running for
    nobody until it ends. So, as uvicorn does, the request is aborted and its slot freed (docs/api.md)."""
    body = json.dumps({"prompt": "Hi", "max_tokens": 8000, "ignore_eos": True})
    before = aborted_requests(server)
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall((HEAD + f"Content-Length: {len(body)}\r\n\r\n{body}").encode())
        sock.shutdown(socket.SHUT_WR)
        assert read_until_closed(sock, time.monotonic() + 30) == b""
    deadline = time.monotonic() + 30
    while aborted_requests(server) == before:
        assert time.monotonic() < deadline, "the request was not aborted"
        time.sleep(0.05)


def aborted_requests(server: ServerProcess) -> float:
    text = httpx.get(f"{server.url}/metrics", headers=AUTH, timeout=10).text
    lines = [line for line in text.splitlines() if line.startswith("rnnserve_request_success_total")]
    return sum(float(line.split()[-1]) for line in lines if 'finished_reason="abort"' in line)


def test_request_heads_are_bounded(server: ServerProcess) -> None:
    """A head that grows past 16 KiB gets a 400 and its connection is closed, whether its excess comes as many
    headers or as one long one; the server keeps serving. The head never ends here: one that arrives whole in one
    read of the socket is parsed (asyncio reads up to 256 KiB at a time; h11 limits incomplete heads alike), and a
    loaded machine may read the pieces of one sent in pieces together."""
    many = "".join(f"X-Filler-{i}: {'v' * 100}\r\n" for i in range(200))
    one = f"X-Filler: {'v' * 40000}\r\n"
    for filler in (many, one):
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            head = f"GET /health HTTP/1.1\r\nHost: localhost\r\n{filler}".encode()
            try:
                for start in range(0, len(head), 4096):
                    sock.sendall(head[start : start + 4096])
                    time.sleep(0.02)  # one read each
            except (BrokenPipeError, ConnectionResetError):
                pass  # closed before the whole head went out: the answer is already waiting
            answer = read_until_closed(sock, time.monotonic() + 15)
        assert answer.startswith(b"HTTP/1.1 400"), answer[:200]
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_an_error_that_ends_a_connection_is_not_lost_to_a_reset(server: ServerProcess) -> None:
    """After the 400 for a head too large the server ends its side and reads on (a lingering close): the client,
    still sending the rest of its request, reads the whole answer in OpenAI's error format and then the end of the
    stream. A server that closed with the client's bytes unread would reset the connection, and a reset can
    destroy the answer before the client reads it; here the sends after the answer would fail with a reset."""
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(f"GET /health HTTP/1.1\r\nHost: localhost\r\nX-Filler: {'v' * 20000}".encode())
        answer = b""
        sock.settimeout(15)
        while b"\r\n\r\n" not in answer or len(answer.partition(b"\r\n\r\n")[2]) < content_length(answer):
            chunk = sock.recv(65536)
            assert chunk, answer
            answer += chunk
        for _ in range(5):  # each send after a reset's arrival would raise
            sock.sendall(b"v" * 4096)
            time.sleep(0.05)
        sock.shutdown(socket.SHUT_WR)
        rest = read_until_closed(sock, time.monotonic() + 15)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400"), head
    assert json.loads(body)["error"]["code"] == "invalid_http_request"
    assert rest == b""


def content_length(response: bytes) -> int:
    """The Content-Length of a response head (0 until the head is whole)."""
    head = response.partition(b"\r\n\r\n")[0].decode("latin-1").lower()
    return next((int(line.split(":")[1]) for line in head.split("\r\n") if line.startswith("content-length:")), 0)
