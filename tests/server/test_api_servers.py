"""Several API server processes in front of one engine process (``rnnserve serve --api-servers N``): each
server gets its own requests' outputs, one stopping leaves the others serving, the metrics count every
server's requests once whichever answers the scrape, and the supervisor stops everything when one dies."""

from __future__ import annotations

import asyncio
import json
import logging
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from rnnserve.server.api_servers import run_api_server
from rnnserve.server.app import create_app
from rnnserve.server.engine_core import EngineProcess, ProcessDriver
from rnnserve.server.http_server import listen_socket
from tests.server.conftest import TINY, tiny_config
from tests.server.server_process import REPO, ServerProcess, running_server

pytestmark = pytest.mark.timeout(240)

BODIES = [
    {"prompt": f"prompt {i}", "max_tokens": 6 + i % 5, "temperature": 0, "ignore_eos": True} for i in range(8)
] + [{"prompt": "seeded", "max_tokens": 7, "temperature": 0.9, "seed": 3, "n": 2}]


def texts(client: TestClient, body: dict, stream: bool) -> list[str]:
    response = client.post("/v1/completions", json={**body, "stream": stream})
    assert response.status_code == 200, response.text
    if not stream:
        return [choice["text"] for choice in response.json()["choices"]]
    found: dict[int, str] = {}
    for line in response.text.splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line.removeprefix("data: "))["choices"]:
                found[choice["index"]] = found.get(choice["index"], "") + choice["text"]
    return [found[i] for i in sorted(found)]


def test_more_than_one_api_server_needs_an_engine_process() -> None:
    with pytest.raises(ValueError, match="its own process"):
        tiny_config(api_servers=2, engine_process="off")
    with pytest.raises(ValueError, match="at least 1"):
        tiny_config(api_servers=0)
    assert tiny_config(api_servers=2).uses_engine_process  # auto, on a CPU
    assert not tiny_config().uses_engine_process


def test_two_servers_share_one_engine_process_and_each_gets_its_own_answers() -> None:
    with TestClient(create_app(tiny_config())) as alone:
        expected = [texts(alone, body, stream=False) for body in BODIES]
    config = tiny_config(api_servers=2, sessions=False)
    engine = EngineProcess(config.engine, num_servers=2)
    apps = [create_app(config, driver=ProcessDriver(conn, engine.info)) for conn in engine.connections]
    with TestClient(apps[1]) as second:
        with TestClient(apps[0]) as first, ThreadPoolExecutor(2) as pool:
            # Both servers' requests run in the engine's batches together; each server streams its own.
            got = pool.map(
                lambda job: texts(*job),
                [(first if i % 2 else second, body, bool(i % 3)) for i, body in enumerate(BODIES)],
            )
            assert list(got) == expected
        # The first server stopped: the engine keeps serving the second.
        assert texts(second, BODIES[0], stream=True) == expected[0]
        metrics = second.get("/metrics").text
        assert re.search(r'^rnnserve_num_requests_running\{model_name="[^"]+"\} 0\.0$', metrics, re.M)
    engine.process.join(30)  # both stopped: the engine process ends
    assert engine.process.exitcode == 0


def test_no_api_server_listens_until_every_one_is_ready() -> None:
    """Connections made while only some servers listen would stay on those (clients keep them alive), so each
    server waits for its siblings before it listens."""
    config = tiny_config(api_servers=2, sessions=False)
    engine = EngineProcess(config.engine, num_servers=2)
    holder = listen_socket("127.0.0.1", 0, reuse_port=True)  # holds the port, as the supervisor's socket does
    address = holder.getsockname()[:2]
    url = f"http://{address[0]}:{address[1]}"
    context = multiprocessing.get_context("spawn")
    all_ready = context.Barrier(3)  # the two servers, and this test standing for a third still starting
    servers = [
        context.Process(target=run_api_server, args=(config, address, conn, engine.info, i, logging.WARNING, all_ready))
        for i, conn in enumerate(engine.connections)
    ]
    try:
        for server, conn in zip(servers, engine.connections, strict=True):
            server.start()
            conn.close()
        deadline = time.monotonic() + 120
        while all_ready.n_waiting < 2:
            assert time.monotonic() < deadline and all(server.is_alive() for server in servers)
            time.sleep(0.05)
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{url}/ready", timeout=5)
        all_ready.wait(5)
        while True:
            try:
                if httpx.get(f"{url}/ready", timeout=5).status_code == 200:
                    break
            except httpx.ConnectError:
                pass
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        for server in servers:
            if server.pid is not None:
                os.kill(server.pid, signal.SIGTERM)
        for server in servers:
            server.join(30)
        holder.close()
    assert None not in [server.exitcode for server in servers]
    engine.process.join(30)
    assert engine.process.exitcode == 0


def wait_for_servers(server: ServerProcess, count: int) -> list[int]:
    """The pids of the ``count`` API server processes once each says it runs."""
    deadline = time.monotonic() + 60
    while server.output.count("Uvicorn running") < count:
        assert server.proc.poll() is None and time.monotonic() < deadline, server.output
        time.sleep(0.1)
    return [int(pid) for pid in re.findall(r"Started server process \[(\d+)\]", server.output)]


async def stream_all(url: str, count: int) -> list[int]:
    """``count`` concurrent streams, each on a connection of its own; the tokens each received."""
    body = {"prompt": "hello", "max_tokens": 8, "temperature": 0, "ignore_eos": True, "stream": True}

    async def one() -> int:
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            async with client.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200
                lines = [line async for line in response.aiter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        return sum(1 for line in lines[:-1] if json.loads(line.removeprefix("data: "))["choices"])

    return await asyncio.gather(*(one() for _ in range(count)))


def metric(text: str, name: str) -> float:
    return sum(float(v) for v in re.findall(rf'^{name}\{{[^}}]*model_name="[^"]+"[^}}]*\}} (\S+)$', text, re.M))


def session_turns(client: httpx.Client, turns: int) -> tuple[str, list[tuple[str, int]]]:
    """A new session and, for each of ``turns`` greedy turns, the turn's text and the session's token count."""
    session = client.post("/v1/sessions", json={}).json()["id"]
    results = []
    for turn in range(turns):
        body = {"prompt": f" turn {turn}", "max_tokens": 3, "temperature": 0, "session_id": session}
        response = client.post("/v1/completions", json=body, headers={"Connection": "close"})
        assert response.status_code == 200, response.text
        count = client.get(f"/v1/sessions/{session}").json()["num_tokens"]
        results.append((response.json()["choices"][0]["text"], count))
    return session, results


def test_rnnserve_serve_with_two_api_servers_counts_every_request_once(tmp_path: Path) -> None:
    flags = ("--model", TINY, "--api-servers", "2", "--max-num-seqs", "8", "--session-dir", str(tmp_path / "s"))
    with running_server(*flags, env={"TMPDIR": str(tmp_path)}) as server:
        assert len(set(wait_for_servers(server, 2))) == 2
        assert list(tmp_path.glob("rnnserve-metrics-*"))
        chunks = asyncio.run(stream_all(server.url, 24))
        assert all(count >= 1 for count in chunks)
        for _ in range(6):  # whichever server answers the scrape counts all 24 once
            text = httpx.get(f"{server.url}/metrics").text
            assert metric(text, "rnnserve_request_success_total") == 24, text
            assert metric(text, "rnnserve_time_to_first_token_seconds_count") == 24
            assert metric(text, "rnnserve_generation_tokens_total") == 24 * 8
            assert metric(text, "rnnserve_state_slots") == 8
            # the serve process, its engine process and both API servers, from whichever answers
            assert metric(text, "rnnserve_server_processes") >= 4
        # A conversation whose turns land on either process (a connection each) continues one state.
        with httpx.Client(base_url=server.url, timeout=60) as http:
            session, turns = session_turns(http, 4)
        assert (tmp_path / "s" / f"{session}.safetensors").exists() and (tmp_path / "s" / ".leases").exists()
        for _ in range(6):  # whichever server answers counts the shared folder, and every server's work
            text = httpx.get(f"{server.url}/metrics").text
            assert metric(text, "rnnserve_sessions") == 1
            assert metric(text, "rnnserve_session_bytes") == (tmp_path / "s" / f"{session}.safetensors").stat().st_size
            assert metric(text, "rnnserve_session_turns_total") == 4
            assert metric(text, "rnnserve_session_operations_total") == 1  # the create
            assert metric(text, "rnnserve_session_cache_queries_total") == 4
            assert metric(text, "rnnserve_session_cache_memory_total_bytes") == 2 * (256 << 20)  # an LRU each
        with TestClient(create_app(tiny_config(session_dir=str(tmp_path / "alone")))) as alone:
            assert turns == session_turns(alone, 4)[1]
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=60) == 0, server.output
    assert "SIGTERM: stopping 2 API servers" in server.output
    assert not list(tmp_path.glob("rnnserve-metrics-*"))  # the shared metrics' folder is removed


@pytest.mark.parametrize("victim", ["API server", "engine"])
def test_a_dead_process_stops_the_others(victim: str) -> None:
    flags = ("--model", TINY, "--api-servers", "2", "--no-sessions")  # --no-sessions: nothing written to ~/.cache
    with running_server(*flags) as server:
        pids = wait_for_servers(server, 2)
        if victim == "engine":
            found = re.search(r"engine=process \(pid (\d+)\), API server pids (\d+), (\d+) ", server.output)
            assert found is not None and sorted(map(int, found.group(2, 3))) == sorted(pids), server.output
            pids = [int(found.group(1))]
        os.kill(pids[0], signal.SIGKILL)
        assert server.proc.wait(timeout=60) == 1, server.output
    expected = r"rnnserve-api-\d exited" if victim == "API server" else "the engine process exited"
    assert re.search(rf"{expected} \(exit code -9\); stopping", server.output), server.output


def test_a_stopped_api_server_leaves_the_others_streams_flowing() -> None:
    """With one API server process stopped (SIGSTOP; a server that stalls), the engine stopped sending outputs to
    every server: each server now has its own flow control, so the other's streams go on, and the stopped one's
    catch up when it continues."""
    flags = ("--model", TINY, "--api-servers", "2", "--max-num-seqs", "8", "--no-sessions")
    with running_server(*flags) as server:
        stopped = wait_for_servers(server, 2)[0]
        try:
            progress = asyncio.run(tokens_while_stopped(server.url, 8, stopped))
        finally:
            os.kill(stopped, signal.SIGCONT)
    while_stopped, after = zip(*progress, strict=True)
    assert max(while_stopped) >= 10, progress  # the other server's streams (it was 0 for all of them)
    assert min(after) >= 1, progress  # every stream, the stopped server's too


async def tokens_while_stopped(url: str, count: int, pid: int) -> list[tuple[int, int]]:
    """``count`` long streams, each on a connection of its own (the kernel spreads them over the servers); once
    each has a token, process ``pid`` stops for 1.5 s: per stream, the tokens it got meanwhile (from 0.5 s on),
    then in the second after the process continued."""
    body = {"prompt": "hello", "max_tokens": 100_000, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}  # fmt: skip
    tokens = [0] * count

    async def stream(index: int) -> None:
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            async with client.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        tokens[index] = json.loads(line.removeprefix("data: "))["usage"]["completion_tokens"]

    streams = [asyncio.create_task(stream(index)) for index in range(count)]
    try:
        deadline = time.monotonic() + 60
        while not all(tokens):
            assert time.monotonic() < deadline and not any(task.done() for task in streams), tokens
            await asyncio.sleep(0.05)
        os.kill(pid, signal.SIGSTOP)
        await asyncio.sleep(0.5)  # what was on its way
        before = list(tokens)
        await asyncio.sleep(1.5)
        during = list(tokens)
        os.kill(pid, signal.SIGCONT)
        await asyncio.sleep(1.0)
        assert not any(task.done() for task in streams), [task.exception() for task in streams if task.done()]
        return [(middle - start, end - middle) for start, middle, end in zip(before, during, tokens, strict=True)]
    finally:
        for task in streams:
            task.cancel()
        await asyncio.gather(*streams, return_exceptions=True)


def test_a_port_where_a_server_listens_is_refused_also_with_several_api_servers() -> None:
    with running_server("--model", TINY, "--api-servers", "2", "--no-sessions") as first:
        wait_for_servers(first, 2)
        second = subprocess.run(
            [sys.executable, "-m", "rnnserve.server.cli", "serve", "--model", TINY, "--api-servers", "2",
             "--port", str(first.port)],
            capture_output=True, text=True, timeout=120, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
        )  # fmt: skip
        assert second.returncode == 1 and "Address already in use" in second.stderr, second.stderr


def test_servers_and_engine_end_when_the_launcher_is_killed() -> None:
    """Killed, the launcher left its API servers serving as orphans (holding the port a restart needs) and the
    engine process with them: now each API server drains on its parent's death, and the engine ends after them."""
    flags = ("--model", TINY, "--api-servers", "2", "--no-sessions")
    with running_server(*flags) as server:
        pids = wait_for_servers(server, 2)
        found = re.search(r"engine=process \(pid (\d+)\)", server.output)
        assert found is not None, server.output
        server.proc.kill()
        server.proc.wait(timeout=30)
        deadline = time.monotonic() + 60
        alive = [*pids, int(found.group(1))]
        while alive and time.monotonic() < deadline:
            alive = [pid for pid in alive if Path(f"/proc/{pid}").exists() and "zombie" not in process_state(pid)]
            time.sleep(0.2)
        assert not alive, f"still running: {alive}"
        with listen_socket("127.0.0.1", server.port):  # the port is free again
            pass


def process_state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split("\n")[0].lower()
    except (OSError, IndexError):
        return "zombie"


def test_a_sigterm_to_the_whole_group_drains_an_engine_process_server() -> None:
    """systemd's KillMode=control-group sends SIGTERM to every process of the service: the engine process died of
    it at once and every in-flight stream failed; now the server drains them and the engine ends after it."""
    with running_server("--model", TINY, "--engine-process", "on", "--no-sessions") as server:
        wait_for_servers(server, 1)
        pids = map(int, filter(str.isdigit, os.listdir("/proc")))
        [engine] = [pid for pid in pids if parent_of(pid) == server.proc.pid and b"spawn_main" in cmdline(pid)]
        body = {"prompt": "hello", "max_tokens": 300, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: {")
            for pid in (engine, server.proc.pid):
                os.kill(pid, signal.SIGTERM)
            rest = "\n".join(lines)
        assert server.proc.wait(timeout=60) == 0, server.output
    assert '"finish_reason": "length"' in rest and rest.rstrip().endswith("data: [DONE]"), rest[-500:]


def parent_of(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def test_an_unusable_session_folder_is_one_line_with_several_api_servers(tmp_path: Path) -> None:
    """It was a raw NotADirectoryError traceback, and the shared metrics' folder was left behind."""
    (tmp_path / "file").write_text("not a folder")
    command = [sys.executable, "-m", "rnnserve.server.cli", "serve", "--model", TINY, "--api-servers", "2",
               "--port", "0", "--session-dir", str(tmp_path / "file" / "sessions")]  # fmt: skip
    done = subprocess.run(command, cwd=REPO, env={**os.environ, "TMPDIR": str(tmp_path)}, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert "cannot use the session folder" in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert not list(tmp_path.glob("rnnserve-metrics-*"))


def test_a_single_server_keeps_its_metrics_out_of_an_inherited_multiprocess_folder(tmp_path: Path) -> None:
    """With $PROMETHEUS_MULTIPROC_DIR in its environment a single server wrote its metrics there and counted the
    requests of earlier runs with its own."""
    folder = tmp_path / "inherited"
    folder.mkdir()
    with running_server("--model", TINY, "--no-sessions", env={"PROMETHEUS_MULTIPROC_DIR": str(folder)}) as server:
        wait_for_servers(server, 1)
        body = {"prompt": "hi", "max_tokens": 2}
        assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).status_code == 200
        assert metric(httpx.get(f"{server.url}/metrics").text, "rnnserve_request_success_total") == 1
    assert not list(folder.iterdir())


def test_an_api_server_stalled_for_the_stall_timeout_is_killed_and_the_server_stops() -> None:
    """An API server stopped for good (SIGSTOP) kept its requests running to max_tokens and its connections
    hanging, and nothing said so: the engine detaches it after --api-server-stall-timeout, aborting its requests,
    and the supervisor kills it, which stops the others (drained) and the server with 1, as a crash does. (Its event
    loop's heartbeat stops as well: whichever of the two notices first has it killed.)"""
    flags = ("--model", TINY, "--api-servers", "2", "--max-num-seqs", "16", "--no-sessions",
             "--api-server-stall-timeout", "1", "--drain-timeout", "1")  # fmt: skip
    with running_server(*flags) as server:
        stalled = wait_for_servers(server, 2)[0]
        try:
            asyncio.run(stall_while_streaming(server.url, 16, stalled))
            assert server.proc.wait(timeout=60) == 1, server.output
        finally:
            if Path(f"/proc/{stalled}").exists():
                os.kill(stalled, signal.SIGKILL)
    engine_saw = re.search(r"API server \d took none of its outputs for [\d.]+ s .*detached as stalled", server.output)
    supervisor_saw = re.search(r"rnnserve-api-\d stalled \(its event loop did not run", server.output)
    assert engine_saw or supervisor_saw, server.output
    assert re.search(r"rnnserve-api-\d stalled .*; killing it", server.output), server.output
    assert re.search(r"rnnserve-api-\d exited \(exit code -9\); stopping", server.output), server.output


def test_an_idle_api_server_that_stalls_is_killed_and_the_server_stops() -> None:
    """An API server stopped (SIGSTOP) while it had no request owed the engine nothing, so nothing noticed it: the
    connections the kernel gave it hung. Its event loop's heartbeat stops, and the supervisor kills it after
    --api-server-stall-timeout, which stops the others and the server with 1, as a crash does."""
    flags = ("--model", TINY, "--api-servers", "2", "--no-sessions", "--api-server-stall-timeout", "2",
             "--drain-timeout", "1")  # fmt: skip
    with running_server(*flags) as server:
        stalled = wait_for_servers(server, 2)[0]
        try:
            os.kill(stalled, signal.SIGSTOP)
            assert server.proc.wait(timeout=60) == 1, server.output
        finally:
            if Path(f"/proc/{stalled}").exists():
                os.kill(stalled, signal.SIGKILL)
    silent = r"rnnserve-api-\d stalled \(its event loop did not run for [\d.]+ s, --api-server-stall-timeout 2\)"
    assert re.search(silent + "; killing it", server.output), server.output
    assert re.search(r"rnnserve-api-\d exited \(exit code -9\); stopping", server.output), server.output


async def stall_while_streaming(url: str, count: int, pid: int) -> None:
    """``count`` long streams, each on a connection of its own (spread over the servers by the kernel: with 16,
    each server has some); once each has a token, process ``pid`` stops, and the streams run until the server
    ends them."""
    body = {"prompt": "hello", "max_tokens": 100_000, "ignore_eos": True, "stream": True}
    started = [False] * count

    async def stream(index: int) -> None:
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            async with client.stream("POST", "/v1/completions", json=body) as response:
                async for line in response.aiter_lines():
                    started[index] |= line.startswith("data: {")

    streams = [asyncio.create_task(stream(index)) for index in range(count)]
    try:
        deadline = time.monotonic() + 60
        while not all(started):
            assert time.monotonic() < deadline and not any(task.done() for task in streams), started
            await asyncio.sleep(0.05)
        os.kill(pid, signal.SIGSTOP)
        await asyncio.wait(streams, timeout=60)  # the other server's end with its drain
    finally:
        for task in streams:
            task.cancel()
        await asyncio.gather(*streams, return_exceptions=True)
