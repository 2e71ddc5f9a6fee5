"""The request counters against what the clients received, request by request: a known mix (answers stopped by
``max_tokens`` and by a stop string, a 429 of a full queue, a client that leaves mid-stream, 400s) moves each
counter by exactly its share (a 400 none: nothing was admitted), with one API server and with two in front of an
engine process."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest

from rnnserve.server.app import create_app
from rnnserve.server.background import serve_in_thread
from tests.server.chaos import scrape
from tests.server.conftest import TINY, tiny_config
from tests.server.server_process import running_server
from tests.server.test_api_servers import wait_for_servers

pytestmark = pytest.mark.timeout(180)

LONG = {"prompt": "Hello", "max_tokens": 100_000, "ignore_eos": True, "stream": True}
GREEDY = {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
COUNTERS = (
    'rnnserve_request_success_total{finished_reason="stop"}',
    'rnnserve_request_success_total{finished_reason="length"}',
    'rnnserve_request_success_total{finished_reason="abort"}',
    'rnnserve_request_success_total{finished_reason="error"}',
    "rnnserve_request_rejected_total",
    "rnnserve_request_params_n_count",
)


def counters(url: str) -> dict[str, float]:
    metrics = scrape(url)
    return {name: metrics.get(name, 0.0) for name in COUNTERS}


def settled(url: str, expected: dict[str, float], timeout: float = 30.0) -> dict[str, float]:
    """The counters once they equal ``expected`` (an abort is counted when the engine has handled it), or after
    ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while (found := counters(url)) != expected and time.monotonic() < deadline:
        time.sleep(0.1)
    return found


async def drive_mix(url: str) -> dict[str, int]:
    """The mix; what the clients received, by outcome."""
    seen = {"stop": 0, "length": 0, "429": 0, "400": 0, "left": 0}
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        bad = await http.post("/v1/completions", json={"prompt": "a", "temperature": -1})
        assert bad.status_code == 400, bad.text
        seen["400"] += 1
        bad = await http.post("/v1/chat/completions", json={"messages": "not a list"})
        assert bad.status_code == 400, bad.text
        seen["400"] += 1
        greedy = await http.post("/v1/completions", json=GREEDY)
        assert greedy.status_code == 200 and greedy.json()["choices"][0]["finish_reason"] == "length", greedy.text
        seen["length"] += 1
        text = greedy.json()["choices"][0]["text"]
        stop = next(char for char in text if char != "\ufffd")  # a whole character the greedy answer holds
        stopped = await http.post("/v1/completions", json={**GREEDY, "stop": [stop]})
        assert stopped.json()["choices"][0]["finish_reason"] == "stop", stopped.text
        seen["stop"] += 1
        async with http.stream("POST", "/v1/completions", json=LONG) as running:  # holds the one slot
            lines = running.aiter_lines()
            await anext(lines)
            short = {**LONG, "max_tokens": 5, "stream": False}
            queued = asyncio.ensure_future(http.post("/v1/completions", json=short))
            while (await asyncio.to_thread(scrape, url)).get("rnnserve_num_requests_waiting") != 1:
                await asyncio.sleep(0.05)
            full = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
            assert full.status_code == 429 and full.json()["error"]["code"] == "queue_full", full.text
            seen["429"] += 1
            seen["left"] += 1  # the running stream's client leaves: the queued request takes its slot
        answered = await queued
        assert answered.json()["choices"][0]["finish_reason"] == "length", answered.text
        seen["length"] += 1
    return seen


def expected_counters(seen: dict[str, int]) -> dict[str, float]:
    """One count per request, by what its client received."""
    return {
        'rnnserve_request_success_total{finished_reason="stop"}': seen["stop"],
        'rnnserve_request_success_total{finished_reason="length"}': seen["length"],
        'rnnserve_request_success_total{finished_reason="abort"}': seen["left"],
        'rnnserve_request_success_total{finished_reason="error"}': 0,
        "rnnserve_request_rejected_total": seen["429"],  # the 400s count nowhere: nothing was admitted
        "rnnserve_request_params_n_count": seen["stop"] + seen["length"] + seen["left"],  # admitted
    }


def test_each_counter_counts_what_the_clients_received() -> None:
    with serve_in_thread(create_app(tiny_config(max_num_seqs=1, max_waiting=1))) as url:
        seen = asyncio.run(drive_mix(url))
        expected = expected_counters(seen)
        assert settled(url, expected) == expected


def test_two_api_servers_count_each_request_once(tmp_path: Path) -> None:
    flags = ("--model", TINY, "--api-servers", "2", "--max-num-seqs", "1", "--max-waiting", "1", "--no-sessions")
    with running_server(*flags, env={"TMPDIR": str(tmp_path)}) as server:
        wait_for_servers(server, 2)
        seen = asyncio.run(drive_mix(server.url))
        expected = expected_counters(seen)
        for _ in range(4):  # whichever server answers the scrape reports the sums over both
            assert settled(server.url, expected) == expected
