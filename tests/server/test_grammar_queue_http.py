"""Requests whose structured output waits to compile, over HTTP: beyond ``--max-compiling`` a 429 in OpenAI's
format (as a full waiting queue answers), counted as waiting and as compiling, and a client that goes away while
its grammar waits gives its place up at once."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import httpx
import pytest

from rnnserve.server.app import create_app
from rnnserve.server.background import serve_in_thread
from tests.server.conftest import hold_grammar_compiles, tiny_config
from tests.server.test_live import scrape

pytestmark = pytest.mark.timeout(180)

BODY = {"prompt": "Hi", "max_tokens": 4, "structured_outputs": {"choice": ["yes", "no"]}}


async def until(condition: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not await asyncio.to_thread(condition):
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


def test_a_full_grammar_queue_is_a_429_and_a_client_gone_while_its_grammar_waits_frees_its_place(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    app = create_app(tiny_config(max_compiling=1, retry_after_seconds=3))
    engine = app.state.engine.engine
    may_finish = hold_grammar_compiles(monkeypatch, engine, timeout=60)

    def gauges(url: str) -> tuple[float, float]:
        metrics = scrape(url)
        return metrics["rnnserve_num_requests_compiling"], metrics["rnnserve_num_requests_waiting"]

    async def scenario(url: str) -> None:
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            first = asyncio.create_task(http.post("/v1/completions", json=BODY))
            await until(lambda: gauges(url) == (1, 1))  # waiting for its grammar: waiting, and compiling
            refused = await http.post("/v1/completions", json=BODY)
            assert refused.status_code == 429, refused.text
            error = refused.json()["error"]
            assert (error["type"], error["code"]) == ("rate_limit_error", "queue_full")
            assert "--max-compiling" in error["message"] and refused.headers["Retry-After"] == "3"

            first.cancel()  # its client goes away while its grammar compiles (held): the place is free at once
            await asyncio.gather(first, return_exceptions=True)
            await until(lambda: gauges(url) == (0, 0))
            second = asyncio.create_task(http.post("/v1/completions", json=BODY))
            await until(lambda: gauges(url) == (1, 1))
            may_finish.release()  # the first's compile, which ran on, ends for nobody
            may_finish.release()
            answer = await second
            assert answer.status_code == 200 and answer.json()["choices"][0]["text"] in ("yes", "no")
        metrics = await asyncio.to_thread(scrape, url)
        assert metrics["rnnserve_request_rejected_total"] == 1
        assert gauges(url) == (0, 0) and metrics["rnnserve_state_slots_used"] == 0

    with serve_in_thread(app) as url:
        asyncio.run(scenario(url))
