"""A real ``rnnserve serve`` shut down with requests still running past --drain-timeout: streams end with an
error event and ``[DONE]``, other requests get a JSON 503, and nothing lands in the log as a traceback."""

from __future__ import annotations

import json
import re
import signal
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import TINY
from tests.server.server_process import REPO, running_server

pytestmark = pytest.mark.timeout(90)
LONG = {"prompt": "Hello", "max_tokens": 8000, "ignore_eos": True}
AUTH = {"Authorization": "Bearer k"}


def wait_until_running(url: str, count: int, timeout: float = 30.0) -> None:
    """Block until the server's metrics count ``count`` running requests: on a loaded machine a request sent from
    a thread may not have reached the server before the signal that closes its socket."""
    deadline = time.monotonic() + timeout
    pattern = re.compile(rf"^rnnserve_num_requests_running\{{[^}}]*\}} {count}\.0$", re.M)
    while not pattern.search(httpx.get(f"{url}/metrics", timeout=10).text):
        assert time.monotonic() < deadline, f"{count} requests never ran"
        time.sleep(0.05)


def test_requests_past_the_drain_timeout_end_with_503() -> None:
    flags = ["--model", TINY, "--max-num-seqs", "4", "--drain-timeout", "1", "--api-key", "k"]
    with running_server(*flags) as server:
        answers: dict[str, httpx.Response] = {}

        def post() -> None:
            answers["r"] = httpx.post(f"{server.url}/v1/completions", json=LONG, headers=AUTH, timeout=60)

        non_streaming = threading.Thread(target=post)
        non_streaming.start()
        wait_until_running(server.url, 1)
        events: list[str] = []
        with httpx.stream(
            "POST", f"{server.url}/v1/completions", json={**LONG, "stream": True}, headers=AUTH, timeout=60
        ) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line[len("data: ") :])
                    if len(events) == 2:
                        server.proc.send_signal(signal.SIGTERM)
        non_streaming.join(timeout=30)
        assert server.proc.wait(timeout=30) == 0
        time.sleep(0.2)  # the log reader catches up
    assert events[-1] == "[DONE]", events[-3:]
    error = json.loads(events[-2])["error"]
    assert error["type"] == "service_unavailable" and "shutting down" in error["message"]
    assert answers["r"].status_code == 503 and answers["r"].json()["error"]["type"] == "service_unavailable"
    assert "Traceback" not in server.output and "KeyError" not in server.output, server.output
    assert "--api-key is visible" in server.output  # the key was given on the command line


def test_a_second_ctrl_c_ends_the_drain_with_503_events_instead_of_cutting_the_streams() -> None:
    """Ctrl-C twice: the second ends the drain at once as its timeout would, so a running stream ends with the 503
    error event and ``[DONE]``; uvicorn forced the exit instead, cutting every stream mid-response (a client saw an
    incomplete chunked body) with an error logged for each."""
    with running_server("--model", TINY, "--max-num-seqs", "2", "--drain-timeout", "120") as server:
        events: list[str] = []
        url = f"{server.url}/v1/completions"
        with httpx.stream("POST", url, json={**LONG, "stream": True}, timeout=60) as response:
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[len("data: ") :])
                if len(events) == 2:
                    server.proc.send_signal(signal.SIGINT)
                    deadline = time.monotonic() + 30
                    while "Shutting down" not in server.output:  # the first one is being handled: a drain
                        assert time.monotonic() < deadline, server.output
                        time.sleep(0.05)
                    server.proc.send_signal(signal.SIGINT)
        assert server.proc.wait(timeout=30) == 0
        time.sleep(0.2)  # the log reader catches up
    assert events[-1] == "[DONE]", events[-3:]
    error = json.loads(events[-2])["error"]
    assert error["type"] == "service_unavailable" and "shutting down" in error["message"]
    assert "ASGI callable returned without completing response" not in server.output, server.output
    assert "Traceback" not in server.output, server.output


def test_a_body_still_arriving_when_the_drain_ends_gets_a_503() -> None:
    """A client sending its body slowly (here: part of it, then nothing) while a longer --request-read-timeout
    runs is answered with a JSON 503 when the drain ends, not held until uvicorn cancels its request with a 500
    (and a traceback) at the end of the grace; the server exits 0."""
    flags = ["--model", TINY, "--drain-timeout", "1", "--request-read-timeout", "120"]
    with running_server(*flags) as server:
        body = json.dumps({"prompt": "Hello", "max_tokens": 4}).encode()
        head = (
            "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        with socket.create_connection(("127.0.0.1", server.port), timeout=60) as sock:
            sock.sendall(head + body[:5])
            wait_until_body_pending(server.url)
            server.proc.send_signal(signal.SIGTERM)
            answer = b""
            while chunk := sock.recv(65536):
                answer += chunk
        assert server.proc.wait(timeout=30) == 0
        time.sleep(0.2)  # the log reader catches up
    status, _, payload = answer.partition(b"\r\n\r\n")
    assert status.startswith(b"HTTP/1.1 503"), answer
    assert b"connection: close" in status.lower(), answer
    error = json.loads(payload)["error"]
    assert error["type"] == "service_unavailable" and "shutting down" in error["message"]
    assert "Traceback" not in server.output and "Cancel" not in server.output, server.output


def wait_until_body_pending(url: str) -> None:
    """Give the server a moment to read the partial request: a GET on another connection is answered only after
    the event loop went past the first one's bytes."""
    for _ in range(3):
        httpx.get(f"{url}/health", timeout=10)


# Loaded by every Python process of the server (as sitecustomize): in those that imported torch, says on stderr that
# the atexit handlers ran, and whether the interpreter's teardown (its modules cleared, its final collections over
# the whole heap) ran after them.
EXIT_PROBE = """
import atexit, os, sys

class TeardownMark:
    armed = False

    def __del__(self, write=os.write):
        if self.armed:
            write(2, b"interpreter teardown ran\\n")

mark = TeardownMark()

def arm(write=os.write):
    if "torch" in sys.modules:
        mark.armed = True
        write(2, b"atexit handlers ran\\n")

atexit.register(arm)
"""


def process_tree(pid: int) -> set[int]:
    """``pid`` and its descendants."""
    tree, todo = set(), [pid]
    while todo:
        tree.add(current := todo.pop())
        for children in Path(f"/proc/{current}/task").glob("*/children"):
            try:
                todo += [int(child) for child in children.read_text().split()]
            except FileNotFoundError:
                pass
    return tree


def shared_memory_files(pids: set[int]) -> set[str]:
    """The files of /dev/shm (POSIX semaphores, shared memory) that these processes have mapped."""
    files = set()
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except (FileNotFoundError, ProcessLookupError):
            continue
        files |= {line.split(None, 5)[5] for line in maps.splitlines() if " /dev/shm/" in line}
    return {name for name in files if not name.endswith("(deleted)")}


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize(
    "flags", [[], ["--engine-process", "on"], ["--api-servers", "2"]], ids=["thread", "engine-process", "api-servers"]
)
def test_a_stopped_server_exits_without_the_interpreters_teardown_and_leaves_nothing(
    tmp_path: Path, flags: list[str]
) -> None:
    """SIGTERM to an idle server: it exits with 0 once its atexit handlers ran, without the interpreter's teardown,
    whose final garbage collections over the start-up heap took seconds (2-3 s idle on a quiet machine, up to 18 s
    on a loaded one) while the port and the pod's grace period were held; and it leaves no process, temporary file
    or shared memory behind, nor a leak report (libtriton's nanobind, multiprocessing's resource tracker)."""
    probe = tmp_path / "probe"
    probe.mkdir()
    (probe / "sitecustomize.py").write_text(EXIT_PROBE)
    temp = tmp_path / "temp"  # the server's temporary files: --api-servers' metrics, multiprocessing's
    temp.mkdir()
    env = {"PYTHONPATH": f"{probe}:{REPO}", "TMPDIR": str(temp)}
    with running_server("--model", TINY, "--max-num-seqs", "2", *flags, env=env) as server:
        assert httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=30).is_success
        processes = process_tree(server.proc.pid)
        shared = shared_memory_files(processes)
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=60) == 0
        deadline = time.monotonic() + 10  # children see their parent's pipes close, then exit
        while any(alive(pid) for pid in processes) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)  # the log reader catches up
    assert not any(alive(pid) for pid in processes)
    assert "atexit handlers ran" in server.output, server.output
    assert "interpreter teardown ran" not in server.output, server.output
    assert "leaked" not in server.output and "Traceback" not in server.output, server.output
    assert not [name for name in shared if Path(name).exists()]
    assert not list(temp.iterdir())
