"""HTTP stacks compared: uvicorn's h11 (pure Python) or httptools (C) protocol, asyncio's or uvloop's event loop.

Three loads per stack, each from a client in another process, stacks alternating round by round; the table gives
medians and their ratios to the first stack (by default h11 + asyncio, what ``rnnserve serve`` ran before
httptools and uvloop):

* **bare**: a minimal FastAPI app whose streams write ``--output-len`` SSE chunks ``--step-ms`` apart: the stack's
  own CPU per chunk written, with nothing else in the process;
* **streams**: the real app (``create_app``), its engine in a process of its own as on a GPU host, on an emulated
  device (``async_scheduling.EmulatedDevice``: ``random:mingru-tiny`` whose steps take ``--step-ms``), under
  ``rnnserve bench`` (``--output-len`` tokens at ``--streams`` concurrency): tok/s and the server process's CPU per
  chunk it wrote (a server that falls behind writes several tokens per chunk, so CPU per token would flatter a
  slow stack);
* **one-token requests** to the same app: req/s and CPU per request.

On a 2-core machine the client, the server and the engine share the cores, so the rates are bound by all three;
the CPU figures are the server's own::

    .venv/bin/python benchmarks/http_stack.py [--step-ms 3] [--streams 128] [--output-len 64] [--rounds 3]
"""

from __future__ import annotations

import sys
from pathlib import Path

# Runs from a checkout without installing: rnnserve finds its folders beside rnnserve/.
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import argparse  # noqa: E402
import asyncio  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
from collections.abc import AsyncIterator  # noqa: E402

import torch  # noqa: E402
from fastapi import FastAPI  # noqa: E402
from fastapi.responses import StreamingResponse  # noqa: E402

from benchmarks.async_scheduling import PRESET, bench_figures, cpu_seconds_while, emulated_app  # noqa: E402
from benchmarks.engine_throughput import served_heap  # noqa: E402
from rnnserve.clients.bench import BenchConfig, Connections  # noqa: E402
from rnnserve.server.background import serve_in_thread  # noqa: E402

STACKS = (("h11", "asyncio"), ("httptools", "asyncio"), ("h11", "uvloop"), ("httptools", "uvloop"))


def bench(url: str, out: Path, requests: int, concurrency: int, output_len: int, processes: int = 1) -> dict:
    """:func:`bench_figures` against ``url``; every request must succeed."""
    figures = bench_figures(url, out, requests, concurrency, output_len, processes)
    if figures["failed"]:
        raise RuntimeError(f"{figures['failed']} requests failed: {figures['failures']}")
    return figures


def median_over_rounds(runs: list[dict], *keys: str) -> float:
    """The median over ``runs`` (figures of :func:`bench`, one per round) of the figure at ``keys`` (e.g.
    ``"ttft_ms", "p50"``); NaN for a round that had none (e.g. the inter-token latency of one-token requests)."""
    values = []
    for figures in runs:
        for key in keys:
            figures = figures[key]
        values.append(float("nan") if figures is None else figures)
    return statistics.median(values)


def bare_app(chunks: int, step_s: float) -> FastAPI:
    """A FastAPI app with one route, ``POST /stream``: ``chunks`` SSE chunks ``step_s`` apart, then ``[DONE]``."""
    app = FastAPI()
    chunk = "data: " + json.dumps({"id": "cmpl-0123456789abcdef", "object": "text_completion", "created": 0,
                                   "model": PRESET, "choices": [{"index": 0, "text": " word"}]}) + "\n\n"  # fmt: skip

    @app.post("/stream")
    async def stream() -> StreamingResponse:
        async def events() -> AsyncIterator[str]:
            for _ in range(chunks):
                await asyncio.sleep(step_s)
                yield chunk
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


async def read_streams(url: str, requests: int, concurrency: int) -> None:
    """Client side of the bare load: ``requests`` streams read to their end over ``concurrency`` kept-alive
    connections (``rnnserve bench``'s)."""
    connections = Connections(BenchConfig(url=url), concurrency)

    async def one() -> None:
        async with connections.borrow() as client, client.stream("POST", "/stream") as response:
            async for _ in response.aiter_bytes():
                pass

    try:
        await asyncio.gather(*(one() for _ in range(requests)))
    finally:
        await connections.aclose()


def run_bare(args: argparse.Namespace, http: str, loop: str) -> float:
    """The bare stack's CPU per chunk written, in microseconds."""
    requests = 2 * args.streams
    app = bare_app(args.output_len, args.step_ms / 1e3)
    with served_heap(), serve_in_thread(app, http=http, loop=loop) as url:  # the heap as `rnnserve serve` has it
        cpu_s = cpu_seconds_while([sys.executable, __file__, "--read-streams", url, str(requests), str(args.streams)])
    return cpu_s / (requests * (args.output_len + 1)) * 1e6


def run_stack(args: argparse.Namespace, http: str, loop: str, out: Path) -> dict[str, float]:
    """The three loads against fresh servers on ``http`` + ``loop``."""
    bare_us_per_chunk = run_bare(args, http, loop)
    app = emulated_app(args.streams, args.step_ms, async_scheduling="on", engine_process="on")
    with served_heap(), serve_in_thread(app, http=http, loop=loop) as url:
        bench(url, out, args.streams, args.streams, 4)  # warm-up: connections, shapes
        streams = bench(url, out, 2 * args.streams, args.streams, args.output_len)
        single = bench(url, out, args.requests, args.streams, 1)
    return {
        "bare_us_per_chunk": bare_us_per_chunk,
        "tok_s": streams["output_throughput"],
        "tokens_per_chunk": streams["total_output_tokens"] / streams["total_chunks"],
        "us_per_chunk": streams["cpu_s"] / streams["total_chunks"] * 1e6,
        "req_s": single["request_throughput"],
        "us_per_request": single["cpu_s"] / single["completed"] * 1e6,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--step-ms", type=float, default=3.0, help="emulated device time per step (default: 3)")
    parser.add_argument("--streams", type=int, default=128, help="concurrent streams (default: 128)")
    parser.add_argument("--output-len", type=int, default=64, help="new tokens per stream (default: 64)")
    parser.add_argument("--requests", type=int, default=1000, help="one-token requests (default: 1000)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds over the stacks, alternating (default: 3)")
    parser.add_argument("--stacks", nargs="+", default=[f"{h}+{lo}" for h, lo in STACKS],
                        choices=[f"{h}+{lo}" for h, lo in STACKS], help="stacks to run, the first is the baseline "
                        "(default: all four, h11+asyncio first)")  # fmt: skip
    parser.add_argument("--read-streams", nargs=3, metavar=("URL", "REQUESTS", "CONCURRENCY"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.read_streams:  # the bare load's client process
        url, requests, concurrency = args.read_streams
        asyncio.run(read_streams(url, int(requests), int(concurrency)))
        return
    torch.set_num_threads(1)
    print(f"{PRESET} on a {args.step_ms:g} ms emulated device step, engine process; {args.streams} streams x "
          f"{args.output_len} tokens, then {args.requests} one-token requests", flush=True)
    stacks = [tuple(name.split("+")) for name in args.stacks]
    runs: dict[tuple[str, ...], list[dict[str, float]]] = {stack: [] for stack in stacks}
    with tempfile.TemporaryDirectory() as folder:
        for round_index in range(args.rounds):
            for stack in stacks if round_index % 2 == 0 else stacks[::-1]:
                http, loop = stack
                runs[stack].append(run_stack(args, http, loop, Path(folder) / "bench.json"))
                last = runs[stack][-1]
                print(f"  round {round_index + 1}, {' + '.join(stack)}: {last['tok_s']:.0f} tok/s, "
                      f"{last['req_s']:.0f} req/s", flush=True)  # fmt: skip
    medians = {stack: {k: statistics.median(r[k] for r in runs[stack]) for k in runs[stack][0]} for stack in stacks}
    base = medians[stacks[0]]
    baseline = f"vs {' + '.join(stacks[0])}"
    columns = [("bare CPU us/chunk", "bare_us_per_chunk", ".1f"), ("stream tok/s", "tok_s", ".0f"),
               ("tokens per chunk", "tokens_per_chunk", ".2f"), ("CPU us/chunk", "us_per_chunk", ".1f"),
               ("one-token req/s", "req_s", ".0f"), ("CPU us/request", "us_per_request", ".0f")]  # fmt: skip
    ratios = {"bare_us_per_chunk", "tok_s", "us_per_chunk", "req_s", "us_per_request"}
    header = ["protocol", "loop"]
    for title, key, _ in columns:
        header += [title, baseline] if key in ratios else [title]
    print("\n| " + " | ".join(header) + " |")
    print("|---|---|" + "---:|" * (len(header) - 2))
    for (http, loop), m in medians.items():
        cells = [http, loop]
        for _, key, spec in columns:
            cells.append(format(m[key], spec))
            if key in ratios:
                cells.append(f"{m[key] / base[key]:.2f}x")
        print("| " + " | ".join(cells) + " |")

if __name__ == "__main__":
    main()
