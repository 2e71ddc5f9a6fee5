"""What a ``/metrics`` scrape costs the event loop with many stored sessions, before and after 2026-11-30.

Before, the stored-session gauges of a shared session folder (``--api-servers`` > 1) were computed at each scrape
by listing the folder and stat'ing every file, and the whole collection (that scan, the ``/proc`` walk of the
processes' series) ran on the event loop: every stream of the server waited for it, and the dashboard's sampler
collected once a second. Now the store keeps the gauges as the folder changes and the collection runs in a
thread. The baseline is rebuilt here as it was: the same render with the folder scan added, on the loop.

Over a folder of ``--sessions`` session files it measures, alternating the two ways ``--rounds`` times: the time
of one scrape, and the longest stall of a 1 ms ticker on the event loop while scrapes run back to back.

Usage: ``python benchmarks/metrics_scrape.py [--sessions 10000] [--rounds 7]``.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rnnserve.engine.models.base import StateSpec  # noqa: E402
from rnnserve.server.metrics import ServerMetrics  # noqa: E402
from rnnserve.server.sessions import SessionCodec, SessionStore, new_session_id  # noqa: E402

SCRAPES = 20  # per measurement


def fill(folder: Path, count: int) -> None:
    """``count`` copies of one stored session, under new ids."""
    codec = SessionCodec("ab" * 32, [StateSpec("h", (64,), torch.float32)], vocab_size=256)
    store = SessionStore(folder, codec, count + 1, 1 << 40, 1 << 20)
    source = store.path(store.create().id)
    for _ in range(count - 1):
        shutil.copyfile(source, folder / f"{new_session_id()}.safetensors")


def old_render(metrics: ServerMetrics, store: SessionStore) -> bytes:
    """The scrape as it was: the render and the shared folder's scan (``SessionStore.stored``), on the loop."""
    store._scan()
    return metrics.render()


async def stall(scrape_on_loop: bool, metrics: ServerMetrics, store: SessionStore) -> tuple[float, float]:
    """The mean time of one scrape, and the longest a 1 ms ticker on the loop was late while they ran."""
    worst = 0.0
    done = False

    async def ticker() -> None:
        nonlocal worst
        while not done:
            start = time.perf_counter()
            await asyncio.sleep(0.001)
            worst = max(worst, time.perf_counter() - start - 0.001)

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0.01)
    start = time.perf_counter()
    for _ in range(SCRAPES):
        if scrape_on_loop:
            old_render(metrics, store)
            await asyncio.sleep(0)
        else:
            await asyncio.to_thread(metrics.render)
    elapsed = (time.perf_counter() - start) / SCRAPES
    done = True
    await task
    return elapsed, worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="rnnserve-scrape-"))
    try:
        fill(folder, args.sessions)
        codec = SessionCodec("ab" * 32, [StateSpec("h", (64,), torch.float32)], vocab_size=256)
        metrics = ServerMetrics("m", 2048)
        store = SessionStore(folder, codec, args.sessions + 1, 1 << 40, 1 << 20, shared=True,
                             metrics=metrics.sessions)  # fmt: skip
        results: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
        for _ in range(args.rounds):
            for on_loop in (True, False):
                results[on_loop].append(asyncio.run(stall(on_loop, metrics, store)))
        print(f"{args.sessions} session files, shared folder, {args.rounds} rounds x {SCRAPES} scrapes (medians)")
        medians = {}
        for on_loop, label in ((True, "before: scan + render on the loop"), (False, "after: render in a thread")):
            scrape = statistics.median(r[0] for r in results[on_loop]) * 1e3
            worst = statistics.median(r[1] for r in results[on_loop]) * 1e3
            medians[on_loop] = (scrape, worst)
            print(f"  {label:36s} scrape {scrape:8.2f} ms   loop stalled up to {worst:8.2f} ms")
        print(f"  after / before: scrape {medians[False][0] / medians[True][0]:.3f}x, "
              f"longest loop stall {medians[False][1] / medians[True][1]:.3f}x")  # fmt: skip
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
