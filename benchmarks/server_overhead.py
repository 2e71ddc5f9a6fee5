"""The serving process's own CPU per request and per streamed chunk, without sockets, clients or an engine.

The real app (``create_app``: middleware, routes, validation, submission, streaming, metrics) runs on uvloop in
this thread, called directly through ASGI, and a scripted engine driver answers it at once: each add is accepted,
and while requests are running, each turn of the event loop is one engine step that gives every running request
one token (``Stepped`` events as the engine loop posts them). What remains is the server's work alone, measured
as this thread's CPU time over many requests, so two trees (or two settings) can be compared to a few percent on
a noisy machine, which the end-to-end HTTP benchmarks cannot do. uvicorn's protocol and the socket writes are
not included (``benchmarks/http_stack.py`` measures those). Two loads, round after round: one-token streamed
requests at ``--concurrency`` (CPU per request) and streams of ``--output-len`` tokens (CPU per chunk, each a
token), to ``/v1/completions`` (16 token ids) and to ``/v1/chat/completions`` (one user message, rendered by
the chat template).

With ``--engine process`` the scripted driver gives way to the real engine (``random:mingru-tiny``, one torch
thread) in a process of its own, as ``rnnserve serve`` runs it on a GPU: the figures are then this whole
process's CPU (the event loop and the threads that carry commands and events across the pipe), so they add the
cost of those crossings to the app's::

    .venv/bin/python benchmarks/server_overhead.py [--engine scripted|process] [--requests 256] [--concurrency 128]
        [--output-len 16] [--rounds 20]
"""

from __future__ import annotations

import sys
from pathlib import Path

# Runs from a checkout without installing: rnnserve finds its folders beside rnnserve/.
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import argparse  # noqa: E402
import asyncio  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import multiprocessing  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Iterator  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from multiprocessing.connection import Connection  # noqa: E402
from typing import Any  # noqa: E402

os.environ["RNNSERVE_CPU_KERNELS"] = "0"  # the engine is never stepped: no need to build (or rebuild) its kernels

import torch  # noqa: E402
import uvloop  # noqa: E402
from fastapi import FastAPI  # noqa: E402

from benchmarks.async_scheduling import emulated_engine  # noqa: E402
from rnnserve.engine.llm_engine import EngineLoad, StepStats, freeze_startup_heap  # noqa: E402
from rnnserve.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput  # noqa: E402
from rnnserve.server.app import ServerConfig, create_app  # noqa: E402
from rnnserve.server.engine_core import (  # noqa: E402
    MAX_UNHANDLED,
    AbortCommand,
    AddCommand,
    Added,
    Command,
    EncodedStep,
    EngineInfo,
    EventHandler,
    HandledCommand,
    ProcessDriver,
    Stepped,
    StopCommand,
    Stopped,
    receive_message,
    send_message,
)

PRESET = "mingru-tiny"


class ScriptedDriver:
    """An engine driver whose engine takes no time: an add is accepted on the next turn of the event loop; while
    requests run, each turn (or, with ``step_interval``, one turn every that many seconds, as a device's steps
    come) is a step that gives all of them a token (byte ``a``), until each has the ``max_tokens`` it asked for.
    ``build_seconds`` sums this thread's CPU time spent building the steps' outputs (the engine's part, not the
    server's)."""

    engine = None

    def __init__(self, info: EngineInfo, step_interval: float = 0.0) -> None:
        self.info = info
        self.step_interval = step_interval
        self.build_seconds = 0.0
        self.running = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._handle: EventHandler | None = None
        # prompt, max_tokens, metrics, tokens generated so far
        self._requests: dict[str, tuple[list[int], int, RequestMetrics, int]] = {}
        self._stepping = False

    def start(self, loop: asyncio.AbstractEventLoop, handle: EventHandler) -> None:
        self._loop, self._handle, self.running = loop, handle, True

    def stop(self, timeout: float) -> None:
        self.running = False

    def send(self, command: Command) -> None:
        assert self._loop is not None and self._handle is not None
        if isinstance(command, AddCommand):
            now = time.monotonic()
            for request_id, prompt in zip(command.request_ids, command.prompts, strict=True):
                token_ids = list(prompt.encode()) if isinstance(prompt, str) else prompt  # chat: rendered text
                self._requests[request_id] = (token_ids, command.params.max_tokens, RequestMetrics(now, now), 0)
            self._loop.call_soon(self._handle, Added(command.add_id, command.request_ids, None, self.info.load))
            if not self._stepping:
                self._stepping = True
                self._schedule_step()
        elif isinstance(command, AbortCommand):
            for request_id in command.request_ids:
                self._requests.pop(request_id, None)

    def _schedule_step(self) -> None:
        assert self._loop is not None
        if self.step_interval:
            self._loop.call_later(self.step_interval, self._step)
        else:
            self._loop.call_soon(self._step)

    def _step(self) -> None:
        assert self._loop is not None and self._handle is not None
        started = time.thread_time()
        now = time.monotonic()
        outputs = []
        for request_id, (prompt, max_tokens, metrics, count) in list(self._requests.items()):
            count += 1
            finished = count >= max_tokens
            metrics.first_token_time = metrics.first_token_time or now
            metrics.previous_token_time, metrics.last_token_time = metrics.last_token_time, now
            if finished:
                metrics.finished_time = now
                del self._requests[request_id]
            else:
                self._requests[request_id] = (prompt, max_tokens, metrics, count)
            sample = CompletionOutput(0, "a", [97], "length" if finished else None, None, 0.0, "a", [97], [], count)
            outputs.append(RequestOutput(request_id, None, prompt, [sample], finished, metrics.copy()))
        stats = StepStats(decode_batch_size=len(outputs), generated_tokens=len(outputs))
        self.build_seconds += time.thread_time() - started
        self._handle(Stepped(outputs, [stats], self.info.load))
        self._stepping = bool(self._requests)
        if self._stepping:
            self._schedule_step()


def scripted_app(concurrency: int, step_interval: float = 0.0) -> FastAPI:
    """The real app with :class:`ScriptedDriver` (stepping every ``step_interval`` seconds) in place of its engine
    (``random:`` preset ``PRESET`` on CPU describes the model: tokenizer, limits, pool)."""
    config = ServerConfig.build(model=f"random:{PRESET}", max_num_seqs=concurrency, engine_process="off", api_key=None)
    app = create_app(config)
    bridge = app.state.engine
    bridge.driver.thread.close()
    info = bridge.driver.info
    load = EngineLoad(0, 0, concurrency, 0, 0)
    bridge.driver = ScriptedDriver(EngineInfo(**{**info.__dict__, "load": load}), step_interval)
    return app


@dataclass
class ScriptedStream:
    """What :func:`run_scripted_engine` keeps of a request: its prompt, tokens asked for and made, those made
    since its last output, its handle once its first output crossed (its later ones are compact), its times."""

    prompt: str | list[int]
    max_tokens: int
    metrics: RequestMetrics
    generated: int = 0
    unsent: int = 0
    handle: int | None = None
    prompt_sent: bool = False


def run_scripted_engine(conn: Connection, load: EngineLoad, step_interval: float) -> None:
    """An engine process that takes no time, serving the API server at the other end of ``conn`` as
    ``run_engine_process`` does, in the messages it would send: the server's commands (adds, aborts, the
    acknowledgements of handled steps, stop) as they come; while requests run, a step every ``step_interval``
    seconds (0: one after the other) that gives each a token (byte ``a``); a step's outputs posted while the
    server holds fewer than ``MAX_UNHANDLED`` unhandled, else merged with the next steps' (a stream's output then
    carries several tokens), as rows (a stream's first and last output) and one column of compact outputs
    (``EncodedStep``, as ``OutputEncoder`` builds them)."""
    freeze_startup_heap()  # what it inherited from the server stays out of its collections
    streams: dict[str, ScriptedStream] = {}
    handles = itertools.count()
    steps: list[StepStats] = []
    unhandled = 0
    next_step = time.monotonic()
    while True:
        timeout = None if not streams else max(0.0, next_step - time.monotonic())
        if conn.poll(timeout):
            for command in receive_message(conn):
                if isinstance(command, AddCommand):
                    now = time.monotonic()
                    if not streams:
                        next_step = now + step_interval
                    max_tokens = command.params.max_tokens
                    for request_id, prompt in zip(command.request_ids, command.prompts, strict=True):
                        streams[request_id] = ScriptedStream(prompt, max_tokens, RequestMetrics(now, now))
                    send_message(conn, Added(command.add_id, command.request_ids, None, load))
                elif isinstance(command, AbortCommand):
                    for request_id in command.request_ids:
                        streams.pop(request_id, None)
                elif isinstance(command, HandledCommand):
                    unhandled -= 1
                elif isinstance(command, StopCommand):
                    send_message(conn, Stopped("stopped"))
                    return
        now = time.monotonic()
        if streams and now >= next_step:
            for stream in streams.values():
                if stream.generated < stream.max_tokens:
                    stream.generated += 1
                    stream.unsent += 1
            steps.append(StepStats(decode_batch_size=len(streams), generated_tokens=len(streams)))
            next_step = max(next_step + step_interval, now)
        if steps and unhandled < MAX_UNHANDLED:
            send_message(conn, scripted_step(streams, handles, steps, load, now))
            unhandled += 1
            steps = []


def scripted_step(
    streams: dict[str, ScriptedStream], handles: Iterator[int], steps: list[StepStats], load: EngineLoad, now: float
) -> EncodedStep:
    """The outputs of ``streams`` since their last ones, as an engine process sends them; forgets those that
    finished."""
    rows: list[tuple] = []
    column: list[Any] = []
    for request_id, stream in list(streams.items()):
        count, stream.unsent = stream.unsent, 0
        if not count:
            continue
        text, token_ids = "a" * count, [97] * count
        metrics = stream.metrics
        metrics.first_token_time = metrics.first_token_time or now
        metrics.previous_token_time, metrics.last_token_time = metrics.last_token_time, now
        finished = stream.generated >= stream.max_tokens
        if stream.handle is not None and not finished:
            column += (stream.handle, text, token_ids)
            continue
        prompt = None
        if not stream.prompt_sent:
            prompt_ids = list(stream.prompt.encode()) if isinstance(stream.prompt, str) else stream.prompt
            prompt = (stream.prompt if isinstance(stream.prompt, str) else None, prompt_ids, None)
            stream.prompt_sent = True
        if finished:
            metrics.finished_time = now
            del streams[request_id]
        else:
            stream.handle = next(handles)
        sample = (0, text, token_ids, "length" if finished else None, None, 0.0, text, token_ids, [], stream.generated,
                  None)  # fmt: skip
        times = dataclasses.astuple(metrics)
        rows.append((request_id, prompt, [sample], finished, times, None, 0, None, None, stream.handle))
    return EncodedStep(rows, steps, load, column)


def scripted_process_app(concurrency: int, step_interval: float) -> FastAPI:
    """The real app whose engine is :func:`run_scripted_engine` in a process of its own (forked), reached as
    ``--api-servers`` reach theirs (``ProcessDriver``: commands written by a thread, outputs read and decoded by
    another): what this process spends is an API server's whole part."""
    app = scripted_app(concurrency)
    bridge = app.state.engine
    server_end, engine_end = multiprocessing.Pipe()
    load = bridge.driver.info.load
    engine = multiprocessing.get_context("fork").Process(target=run_scripted_engine, args=(engine_end, load,
                                                                                           step_interval), daemon=True)
    engine.start()
    engine_end.close()
    bridge.driver = ProcessDriver(server_end, bridge.driver.info)
    return app


def process_app(concurrency: int) -> FastAPI:
    """The real app with its real engine (``random:`` preset ``PRESET``, one torch thread, on CPU) in a process
    of its own."""
    config = ServerConfig.build(model=f"random:{PRESET}", max_num_seqs=concurrency, max_num_batched_tokens=
                                16 * concurrency, engine_process="on", api_key=None)  # fmt: skip
    return create_app(config, engine_factory=functools.partial(emulated_engine, 0.0))


async def lifespan(app: FastAPI) -> tuple[asyncio.Queue, asyncio.Task]:
    """Start the app's lifespan; put ``lifespan.shutdown`` on the queue and await the task to end it."""
    messages: asyncio.Queue = asyncio.Queue()
    started = asyncio.Event()

    async def send(message: dict) -> None:
        if message["type"] == "lifespan.startup.complete":
            started.set()
        elif message["type"].endswith("failed"):
            raise RuntimeError(message)

    await messages.put({"type": "lifespan.startup"})
    task = asyncio.ensure_future(app({"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}, messages.get, send))
    await started.wait()
    return messages, task


ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


def request_body(endpoint: str, max_tokens: int) -> bytes:
    """A streamed request: 16 token ids for completions, one short user message for chat."""
    if endpoint == "chat":
        prompt: dict[str, Any] = {"messages": [{"role": "user", "content": "Say something about recurrences."}]}
    else:
        prompt = {"prompt": list(range(16))}
    return json.dumps({**prompt, "max_tokens": max_tokens, "stream": True}).encode()


async def streamed_request(app: FastAPI, path: str, body: bytes) -> None:
    """POST ``body`` to ``path`` through ASGI; raises unless the answer is a 200 whose events end with ``[DONE]``
    and include no error."""
    headers = [(b"host", b"127.0.0.1:8000"), (b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())]  # fmt: skip
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "", "headers": headers,
             "client": ("127.0.0.1", 40000), "server": ("127.0.0.1", 8000), "state": {}}  # fmt: skip
    sent = False
    disconnected = asyncio.Event()
    status = 0
    chunks: list[bytes] = []

    async def receive() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    await app(scope, receive, send)
    disconnected.set()
    text = b"".join(chunks).decode()
    if status != 200 or not text.endswith("data: [DONE]\n\n") or '"error"' in text:
        raise RuntimeError(f"request failed: {status} {text[:200]!r}")


async def load(
    app: FastAPI, endpoint: str, requests: int, concurrency: int, output_len: int, clock: Callable[[], float]
) -> float:
    """``requests`` streamed requests to ``endpoint``, ``concurrency`` at a time: the CPU seconds ``clock``
    counted meanwhile."""
    path, body = ENDPOINTS[endpoint], request_body(endpoint, output_len)
    pending = iter(range(requests))

    async def client() -> None:
        for _ in pending:
            await streamed_request(app, path, body)

    start = clock()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return clock() - start


async def measure(args: argparse.Namespace) -> dict[tuple[str, str], list[float]]:
    """Per endpoint and round, CPU us per one-token request and per chunk of the streams."""
    scripted = args.engine == "scripted"
    app = scripted_app(args.concurrency) if scripted else process_app(args.concurrency)
    clock = time.thread_time if scripted else time.process_time
    messages, task = await lifespan(app)
    figures: dict[tuple[str, str], list[float]] = {}
    for endpoint in ENDPOINTS:
        await load(app, endpoint, args.concurrency, args.concurrency, 4, clock)  # warm-up
    freeze_startup_heap()  # as `rnnserve serve` does
    for _ in range(args.rounds):
        for endpoint in ENDPOINTS:
            cpu = await load(app, endpoint, args.requests, args.concurrency, 1, clock)
            figures.setdefault((endpoint, "request"), []).append(cpu / args.requests * 1e6)
            cpu = await load(app, endpoint, args.concurrency, args.concurrency, args.output_len, clock)
            figures.setdefault((endpoint, "chunk"), []).append(cpu / (args.concurrency * args.output_len) * 1e6)
    await messages.put({"type": "lifespan.shutdown"})
    await task
    return figures


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=("scripted", "process"), default="scripted",
                        help="a scripted engine in this thread, or the real one in a process (default: scripted)")
    parser.add_argument("--requests", type=int, default=256, help="one-token requests per round (default: 256)")
    parser.add_argument("--concurrency", type=int, default=128, help="requests in flight (default: 128)")
    parser.add_argument("--output-len", type=int, default=16, help="tokens per stream (default: 16)")
    parser.add_argument("--rounds", type=int, default=20, help="rounds (default: 20)")
    args = parser.parse_args(argv)
    if args.rounds < 2:
        parser.error("--rounds must be at least 2 (the table gives quartiles)")
    torch.set_num_threads(1)
    figures = uvloop.run(measure(args))
    engine = "scripted engine" if args.engine == "scripted" else f"{PRESET} in an engine process (CPU of this process)"
    print(f"rnnserve's app in process on uvloop, {engine}; concurrency {args.concurrency}, {args.rounds} rounds: "
          "the fastest round (the machine's noise only adds time), the 25th percentile, the median")
    print(f"{'CPU us':44s} {'fastest':>8s} {'p25':>8s} {'median':>8s}")
    units = {"request": "per one-token request", "chunk": f"per chunk, streams of {args.output_len} tokens"}
    for (endpoint, unit), values in figures.items():
        name = f"{endpoint}: {units[unit]}"
        quartiles = statistics.quantiles(values, n=4, method="inclusive")  # within the data, also for 2 rounds
        print(f"{name:44s} {min(values):8.1f} {quartiles[0]:8.1f} {quartiles[1]:8.1f}")


if __name__ == "__main__":
    main()
