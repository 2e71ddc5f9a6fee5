"""A real ``rnnserve serve`` process under steady load from the bench module, shared by the deploy tests."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest

from rnnserve.clients.bench import BenchConfig, benchmark
from tests.server.conftest import TINY
from tests.server.server_process import ServerProcess, running_server


class BenchLoad:
    """``rnnserve bench`` rounds against ``url`` in a thread, one after another until stopped."""

    def __init__(self, url: str) -> None:
        self.config = BenchConfig(url=url, num_prompts=8, concurrency=4, input_len=24, output_len=48, progress=False)
        self.stopping = threading.Event()
        self.rounds: list[dict] = []
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        while not self.stopping.is_set():
            self.rounds.append(asyncio.run(benchmark(self.config)))

    def __enter__(self) -> BenchLoad:
        self.thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stopping.set()
        self.thread.join(timeout=60)


@pytest.fixture(scope="package")
def loaded_server() -> Iterator[ServerProcess]:
    """random:mingru-tiny with 8 slots, kept busy by four concurrent streaming requests at a time."""
    with running_server("--model", TINY, "--max-num-seqs", "8") as server, BenchLoad(server.url) as load:
        yield server
    assert load.rounds and all(r["failed"] == 0 for r in load.rounds), load.rounds[-1:]
