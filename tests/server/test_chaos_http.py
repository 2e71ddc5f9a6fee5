"""Chaos: a seeded storm of clients that behave and clients that misbehave (disconnects before the first byte,
mid-stream, while a grammar compiles or while queued behind busy slots; half bodies; invalid JSON; client
timeouts), mixed with streamed and non-streamed completions and chats, ``n`` > 1, ``best_of``, logprobs,
structured outputs, stop strings, sessions and prefix-cache hits. After each round and a short settle nothing may
be left behind: every state slot free, the load gauges idle, every admitted request counted as finished, no
session still leased, no engine error, no 5xx, the same greedy text as before, and memory bounded after a
warm-up round. The storm itself is in ``chaos.py``."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import re
import threading
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI

from rnnserve.engine.llm_engine import LLMEngine
from rnnserve.server.app import create_app
from rnnserve.server.background import serve_in_thread
from rnnserve.server.engine_core import EngineCore, EngineInfo, ProcessDriver, ServerLinks
from tests.server.chaos import (
    GREEDY,
    Storm,
    admitted_requests,
    busy_gauges,
    finished_requests,
    scrape,
    wait_until_idle,
)
from tests.server.conftest import TINY, tiny_config
from tests.server.server_process import running_server

pytestmark = pytest.mark.timeout(180)

SLOTS = 2  # fewer slots than clients: many requests queue, and some leave while queued
ROUNDS = 2  # after a warm-up round
RSS_GROWTH_BOUND = 48 * 2**20  # over the rounds after the warm-up: allocator caches settle within it


def greedy_text(url: str) -> str:
    response = httpx.post(f"{url}/v1/completions", json=GREEDY, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def storm_round(url: str, seed: int, clients: int = 10, actions: int = 10) -> dict[str, float]:
    """One storm; asserts that it left nothing behind and returns the settled metrics."""
    storm = Storm(url, seed=seed, clients=clients, actions=actions)
    asyncio.run(storm.run())
    assert storm.problems == [], storm.problems
    metrics = wait_until_idle(url)
    assert busy_gauges(metrics) == {}
    assert finished_requests(metrics) == admitted_requests(metrics) > 0
    assert metrics['rnnserve_request_success_total{finished_reason="error"}'] == 0
    storm.delete_sessions()  # a session still leased by a request that left would answer 409
    assert storm.problems == [], storm.problems
    return metrics


def server_flags(tmp_path: Path, *flags: str) -> list[str]:
    return ["--model", TINY, "--max-num-seqs", str(SLOTS), "--max-waiting", "64",
            "--session-dir", str(tmp_path / "sessions"), *flags]  # fmt: skip


def test_a_storm_of_misbehaving_clients_leaves_nothing_behind(tmp_path: Path) -> None:
    with running_server(*server_flags(tmp_path)) as server:
        before = greedy_text(server.url)
        storm_round(server.url, seed=0)  # warm-up: caches, arenas and lazily built paths fill here
        memory = [scrape(server.url)["rnnserve_server_processes_resident_memory_bytes"]]
        for seed in range(1, ROUNDS + 1):
            memory.append(storm_round(server.url, seed)["rnnserve_server_processes_resident_memory_bytes"])
        assert greedy_text(server.url) == before
        assert memory[-1] - memory[0] < RSS_GROWTH_BOUND, [f"{m / 2**20:.1f} MiB" for m in memory]
    assert "Traceback" not in server.output and " ERROR " not in server.output, server.output[-3000:]


def test_a_storm_against_two_api_servers_and_an_engine_process_leaves_nothing_behind(tmp_path: Path) -> None:
    with running_server(*server_flags(tmp_path, "--api-servers", "2")) as server:
        before = greedy_text(server.url)
        storm_round(server.url, seed=5)
        assert greedy_text(server.url) == before
    assert "Traceback" not in server.output and " ERROR " not in server.output, server.output[-3000:]


def debug_tasks_route(app: FastAPI) -> None:
    """``GET /debug/tasks``: the names of the coroutines of the event loop's tasks, but the request's own."""

    @app.get("/debug/tasks")
    async def tasks() -> list[str]:
        current = asyncio.current_task()
        return sorted(task.get_coro().__qualname__ for task in asyncio.all_tasks() if task is not current)


# The event loop's default executor (asyncio.to_thread: session files) keeps up to this many threads.
EXECUTOR_THREADS = min(32, (os.cpu_count() or 1) + 4)


def own_threads() -> set[str]:
    """The names of this process's threads but the event loop's executor's (``asyncio_N``, ``uvloop_N``)."""
    return {t.name for t in threading.enumerate() if not re.fullmatch(r"(asyncio|uvloop)_\d+", t.name)}


@pytest.fixture
def in_process(tmp_path: Path) -> Iterator[tuple[FastAPI, str]]:
    config = tiny_config(max_num_seqs=SLOTS, max_waiting=64, max_prompt_tokens=None, max_body_bytes=1 << 20,
                         session_dir=str(tmp_path / "sessions"))  # fmt: skip
    app = create_app(config)
    debug_tasks_route(app)
    with serve_in_thread(app) as url:
        yield app, url


def test_a_storm_leaks_no_task_thread_request_or_lease_in_the_server_process(in_process: tuple[FastAPI, str]) -> None:
    app, url = in_process
    tasks = httpx.get(f"{url}/debug/tasks", timeout=30).json()
    threads = own_threads()
    storm_round(url, seed=10)
    storm_round(url, seed=11)
    assert httpx.get(f"{url}/debug/tasks", timeout=30).json() == tasks
    assert own_threads() - threads <= {"rnnserve-grammar_0"}  # the grammar thread starts with the first schema
    assert len(threading.enumerate()) - len(threads) <= EXECUTOR_THREADS + 1
    bridge = app.state.engine
    assert (bridge._consumers, bridge._adds, bridge.queued_bytes) == ({}, {}, 0)
    assert bridge.engine.pool.num_used == 0 and not bridge.engine.has_unfinished_requests()
    assert app.state.sessions._leases == {}
    assert app.state.body_reads._reads == set()


@dataclass
class TwoServers:
    """Two API servers' apps, each on a socket of its own, and the engine loop behind them (:class:`ServerLinks`
    over pipes, as in an engine process) on a thread of this process: every map either side keeps per request
    can be looked at."""

    engine: LLMEngine
    links: ServerLinks
    core: EngineCore
    apps: list[FastAPI]
    urls: list[str]


@pytest.fixture
def two_servers(tmp_path: Path) -> Iterator[TwoServers]:
    config = tiny_config(api_servers=2, max_num_seqs=SLOTS, max_waiting=8, max_prompt_tokens=None,
                         max_body_bytes=1 << 20, session_dir=str(tmp_path / "sessions"))  # fmt: skip
    engine = LLMEngine.from_config(config.engine)
    pipes = [multiprocessing.Pipe() for _ in range(2)]
    links = ServerLinks([engine_end for _, engine_end in pipes])
    core = EngineCore(engine, links.next_command, links.post, links.encoder.row, links, encoder=links.encoder)
    loop = threading.Thread(target=core.run, name="test-engine-loop", daemon=True)
    loop.start()
    info = EngineInfo.of(engine)
    apps = [create_app(config, driver=ProcessDriver(server_end, info)) for server_end, _ in pipes]
    with ExitStack() as servers:
        urls = []
        for app in apps:
            debug_tasks_route(app)
            urls.append(servers.enter_context(serve_in_thread(app)))
        yield TwoServers(engine, links, core, apps, urls)
    loop.join(30)
    assert not loop.is_alive()


class BurstyStorm(Storm):
    """The storm beside bursts that fill the waiting queue: its stream cuts may meet a 429 too."""

    def expect(self, kind: str, ok: bool, detail: str) -> None:
        super().expect(kind, ok or (kind == "cut-mid-stream" and detail == "429"), detail)


async def burst(url: str, count: int) -> list[int]:
    """``count`` long completions at once (more than the slots and the waiting queue hold): some get 429."""
    body = {"prompt": "The ", "max_tokens": 32, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=httpx.Limits(max_connections=count)) as http:
        answers = await asyncio.gather(*(http.post("/v1/completions", json=body) for _ in range(count)))
    return [r.status_code for r in answers]


def rejected_and_cut(url: str) -> None:
    """Requests refused before they reach the engine (400s) and after it took them (n > 1 cut mid-stream)."""
    with httpx.Client(base_url=url, timeout=60) as http:
        for body in ({"prompt": "a", "temperature": -1}, {"prompt": "a", "n": 1000}, {"prompt": []}):
            assert http.post("/v1/completions", json=body).status_code == 400
        body = {"prompt": "The ", "max_tokens": 500, "ignore_eos": True, "stream": True, "n": 2}
        with http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            next(response.iter_lines())


def test_two_api_servers_leave_nothing_behind_in_the_engine_loop_or_either_server(two_servers: TwoServers) -> None:
    """Every map either side of the pipes keeps per request is empty once a mixed load settled: the engine's
    requests, slots, owners and encoder streams, and each server's consumers, adds, decoder streams, session
    leases, body reads and event-loop tasks."""
    urls = two_servers.urls
    tasks = [httpx.get(f"{url}/debug/tasks", timeout=30).json() for url in urls]

    async def load() -> list[list[int]]:
        storms = [BurstyStorm(url, seed=20 + i, clients=6, actions=8) for i, url in enumerate(urls)]
        statuses = await asyncio.gather(*(burst(url, 24) for url in urls), *(storm.run() for storm in storms))
        for storm in storms:
            assert storm.problems == [], storm.problems
            storm.delete_sessions()
            assert storm.problems == [], storm.problems
        return statuses[:2]

    bursts = asyncio.run(load())
    assert all(set(statuses) <= {200, 429} for statuses in bursts), bursts
    assert 429 in bursts[0] + bursts[1]
    for url in urls:
        rejected_and_cut(url)
    for url in urls:
        metrics = wait_until_idle(url)
        assert busy_gauges(metrics) == {}
        # Each app has its own registry here (no multiprocess folder), so its ``rnnserve_sessions`` is the shared
        # folder's count when it last changed it; the sessions it keeps in memory are its own.
        assert metrics["rnnserve_session_cache_memory_used_bytes"] == 0
    assert min(wait_until_idle(url)["rnnserve_sessions"] for url in urls) == 0
    for url, before in zip(urls, tasks, strict=True):
        assert httpx.get(f"{url}/debug/tasks", timeout=30).json() == before
    engine, links = two_servers.engine, two_servers.links
    assert engine.pool.num_used == 0 and not engine.has_unfinished_requests()
    assert (engine.scheduler.running, list(engine.scheduler.waiting), engine._uncollected) == ({}, [], {})
    assert two_servers.core.compiling == []
    assert links.owners == {}
    assert (links.encoder.sent, links.encoder.compact, links.encoder.columns) == (set(), {}, {})
    assert list(links.received) == [] and set(links.unhandled.values()) == {0}
    for app in two_servers.apps:
        bridge = app.state.engine
        assert (bridge._consumers, bridge._adds, bridge.queued_bytes) == ({}, {}, 0)
        assert (bridge.driver.decoder.known, bridge.driver.decoder.streams) == ({}, {})
        assert app.state.sessions._leases == {}
        assert app.state.body_reads._reads == set()
    assert all(not app.state.sessions._cache for app in two_servers.apps)
