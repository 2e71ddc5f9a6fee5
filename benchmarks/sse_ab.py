"""The API server's CPU per streamed token, two checkouts measured in the same run: this one against ``--base``.

Each checkout serves the real app (``create_app``) through the real HTTP stack (``build_server``: uvicorn with
httptools and uvloop where installed) in a worker process of its own, importing from that checkout, with the
engine replaced by a scripted one that steps every ``--step-ms`` and gives each running request one token a
step: the device is taken out. By default (``--engine process``) the scripted engine runs in a process of its own
(``server_overhead.run_scripted_engine``) and the server reaches it as each of ``--api-servers`` reaches the
engine process (``ProcessDriver``: a thread writes the commands, another reads and decodes the outputs), which
sends what ``run_engine_process`` would (rows and columns, steps merged into one output per stream while the
server holds two unhandled): the worker's CPU time is an API server's whole part, from the engine's bytes to its
SSE bytes written. With ``--engine loop`` the engine is ``server_overhead.ScriptedDriver`` in the event loop,
which builds ``RequestOutput`` objects itself (timed and taken off): the server's path from an output to its
bytes alone. A client process (raw sockets on uvloop, kept-alive connections) keeps ``--concurrency`` streams of
``--output-len`` tokens going, ``--requests-per-stream`` in a row on each connection, and checks that every
response is a 200 ending with ``[DONE]`` and carrying no error. Four loads: completions and chat, each with and
without ``stream_options.include_usage``. The two workers take turns load by load, the order swapped each round,
so a machine whose speed drifts slows both alike; the table gives medians of the rounds, the median of the
paired ratios ``this / base``, the kernel's part (system time: mostly the socket writes), the tokens an event
carried (above 1: the server fell behind the engine and wrote several tokens an event) and the tokens per second
the client read, and the parts of the CPU (included in the total) spent in the driver's two threads: the reader
(``read``: unpickling the engine process's messages and decoding them into outputs) and the command writer
(``send``: mostly the acknowledgement of each message handled). A short ``--step-ms`` (e.g. 1) has the engine step
faster than a server can write: the saturated case, whose tokens per CPU second are what a server core delivers::

    git worktree add /tmp/base HEAD
    python benchmarks/sse_ab.py --base /tmp/base [--concurrency 256] [--output-len 64] [--step-ms 25] [--rounds 5]
        [--engine process|loop]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOADS = (("completions", False), ("completions", True), ("chat", False), ("chat", True))
PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


def request_bytes(endpoint: str, usage: bool, output_len: int, port: int) -> bytes:
    """One streamed request as it goes on the wire: 16 token ids for completions, one user message for chat."""
    body: dict = {"max_tokens": output_len, "stream": True}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": "Say something about recurrences."}]
    else:
        body["prompt"] = list(range(16))
    if usage:
        body["stream_options"] = {"include_usage": True}
    data = json.dumps(body).encode()
    head = (f"POST {PATHS[endpoint]} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n")  # fmt: skip
    return head.encode() + data


class StreamClient(asyncio.Protocol):
    """One kept-alive connection that sends ``requests`` requests one after the other, each when the previous
    response's last chunk (``0\\r\\n\\r\\n``) came; counts the events it read."""

    def __init__(self, request: bytes, requests: int, done: asyncio.Future[None]) -> None:
        self.request = request
        self.left = requests
        self.done = done
        self.parts: list[bytes] = []
        self.events = 0
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.transport.write(self.request)  # type: ignore[union-attr]

    def data_received(self, data: bytes) -> None:
        self.parts.append(data)
        self.events += data.count(b"data: ")
        if not data.endswith(b"0\r\n\r\n"):  # the last chunk may come in a packet of its own
            return
        response = b"".join(self.parts)
        if not response.endswith(b"\r\n0\r\n\r\n"):
            return
        self.parts.clear()
        if not response.startswith(b"HTTP/1.1 200") or b"data: [DONE]" not in response or b'"error"' in response:
            self.done.set_exception(RuntimeError(f"bad response: {response[:300]!r}"))
            self.transport.close()  # type: ignore[union-attr]
            return
        self.left -= 1
        if self.left:
            self.transport.write(self.request)  # type: ignore[union-attr]
        else:
            self.transport.close()  # type: ignore[union-attr]
            self.done.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_exception(exc or RuntimeError("connection closed early"))


async def run_client(port: int, request: bytes, connections: int, requests: int) -> int:
    """``connections`` connections of ``requests`` streamed requests each; the events read."""
    loop = asyncio.get_running_loop()
    clients = []
    for _ in range(connections):
        done = loop.create_future()
        _, client = await loop.create_connection(lambda d=done: StreamClient(request, requests, d), "127.0.0.1", port)
        clients.append(client)
    await asyncio.gather(*(c.done for c in clients))
    return sum(c.events for c in clients)


def client_main(args: argparse.Namespace) -> None:
    import uvloop

    request = request_bytes(args.endpoint, args.usage, args.output_len, args.port)
    events = uvloop.run(run_client(args.port, request, args.concurrency, args.requests_per_stream))
    print(events)


def load_server_overhead() -> object:
    """This checkout's ``benchmarks/server_overhead.py`` (its scripted driver), with ``rnnserve`` already imported
    from the worker's checkout."""
    spec = importlib.util.spec_from_file_location("server_overhead", ROOT / "benchmarks" / "server_overhead.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules["server_overhead"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


async def serve_loads(args: argparse.Namespace) -> None:
    """Serve the scripted app on ``--port``; for each line ``endpoint usage`` on stdin, run that load with a client
    process and print this process's CPU and the driver's building, in microseconds per token, as JSON."""
    overhead = load_server_overhead()
    from rnnserve.engine.llm_engine import freeze_startup_heap
    from rnnserve.server.http_server import build_server, listen_socket

    if args.engine == "process":
        app = overhead.scripted_process_app(args.concurrency, args.step_ms / 1e3)  # type: ignore[attr-defined]
    else:
        app = overhead.scripted_app(args.concurrency, args.step_ms / 1e3)  # type: ignore[attr-defined]
    config = app.state.config
    config.log_level, config.access_log = "warning", False
    server = build_server(app, config)
    sock = listen_socket("127.0.0.1", args.port)
    args.port = sock.getsockname()[1]  # the port bound (--port 0: a free one), which the clients connect to
    serving = asyncio.ensure_future(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.05)
    driver = app.state.engine.driver

    def building() -> float:
        """The CPU seconds this process spent building outputs as the engine (none with an engine process)."""
        return getattr(driver, "build_seconds", 0.0)

    # an engine process's driver: the thread that unpickles and decodes its messages, the one that writes commands
    reader, sender = getattr(driver, "_reader", None), getattr(getattr(driver, "_sender", None), "thread", None)
    clocks = [time.pthread_getcpuclockid(thread.ident) if thread is not None and thread.ident else None
              for thread in (reader, sender)]  # fmt: skip

    def thread_seconds() -> list[float]:
        """The CPU seconds of the driver's reader and command threads so far (0 with the engine in the loop)."""
        return [0.0 if clock is None else time.clock_gettime(clock) for clock in clocks]

    freeze_startup_heap()  # as `rnnserve serve` does
    loop = asyncio.get_running_loop()
    print("ready", flush=True)
    while line := await loop.run_in_executor(None, sys.stdin.readline):
        endpoint, usage = line.split()
        command = [sys.executable, str(Path(__file__).resolve()), "--client", "--port", str(args.port),
                   "--endpoint", endpoint, "--concurrency", str(args.concurrency), "--output-len",
                   str(args.output_len), "--requests-per-stream", str(args.requests_per_stream)]  # fmt: skip
        if usage == "1":
            command.append("--usage")
        before, built, threads = resource.getrusage(resource.RUSAGE_SELF), building(), thread_seconds()
        started = time.monotonic()
        client = await asyncio.create_subprocess_exec(*command, stdout=subprocess.PIPE)
        out, _ = await client.communicate()
        after, wall = resource.getrusage(resource.RUSAGE_SELF), time.monotonic() - started
        if client.returncode:
            raise RuntimeError("the client failed")
        tokens = args.concurrency * args.requests_per_stream * args.output_len
        cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime - (building() - built)
        system = after.ru_stime - before.ru_stime
        print(json.dumps({"us_per_token": cpu / tokens * 1e6, "system_us_per_token": system / tokens * 1e6,
                          "built_us_per_token": (building() - built) / tokens * 1e6,
                          "reader_us_per_token": (thread_seconds()[0] - threads[0]) / tokens * 1e6,
                          "sender_us_per_token": (thread_seconds()[1] - threads[1]) / tokens * 1e6, "tokens_per_event":
                          tokens / int(out), "tokens_per_second": tokens / wall}), flush=True)  # fmt: skip
    server.should_exit = True
    await serving


def worker_main(args: argparse.Namespace) -> None:
    import uvloop

    os.environ["RNNSERVE_CPU_KERNELS"] = "0"  # the model never runs: no need to build its kernels
    sys.path.insert(0, args.worker)
    import torch

    import rnnserve  # noqa: F401 - from the worker's checkout, before server_overhead puts this one first

    torch.set_num_threads(1)
    uvloop.run(serve_loads(args))


def start_worker(checkout: Path, port: int, args: argparse.Namespace) -> subprocess.Popen[str]:
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", str(checkout), "--port", str(port),
               "--concurrency", str(args.concurrency), "--output-len", str(args.output_len), "--step-ms",
               str(args.step_ms), "--requests-per-stream", str(args.requests_per_stream),
               "--engine", args.engine]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=checkout)
    line = proc.stdout.readline()  # type: ignore[union-attr]
    if line.strip() != "ready":
        raise RuntimeError(f"worker for {checkout} did not start: {line!r}")
    return proc


def run_load(proc: subprocess.Popen[str], endpoint: str, usage: bool) -> dict[str, float]:
    proc.stdin.write(f"{endpoint} {int(usage)}\n")  # type: ignore[union-attr]
    proc.stdin.flush()  # type: ignore[union-attr]
    return json.loads(proc.stdout.readline())  # type: ignore[union-attr]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", type=Path, help="the checkout to compare against (e.g. a worktree of HEAD)")
    parser.add_argument("--concurrency", type=int, default=256, help="streams in flight (default: 256)")
    parser.add_argument("--output-len", type=int, default=64, help="tokens per stream (default: 64)")
    parser.add_argument("--requests-per-stream", type=int, default=2, help="requests per connection (default: 2)")
    parser.add_argument("--step-ms", type=float, default=25.0, help="the scripted engine's step (default: 25)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds (default: 5)")
    parser.add_argument("--engine", choices=("process", "loop"), default="process",
                        help="the scripted engine in a process of its own, reached as --api-servers reach theirs "
                        "(default), or in the server's event loop")
    parser.add_argument("--port", type=int, default=18100, help="the first of two ports (default: 18100; 0: free ones)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--endpoint", help=argparse.SUPPRESS)
    parser.add_argument("--usage", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.client:
        return client_main(args)
    if args.worker:
        return worker_main(args)
    if args.base is None:
        parser.error("--base is required")
    checkouts = {"base": args.base.resolve(), "this": ROOT}
    ports = [args.port + i if args.port else 0 for i in range(len(checkouts))]  # 0: a free one each
    workers = {name: start_worker(checkouts[name], port, args) for name, port in zip(checkouts, ports, strict=True)}
    figures: dict[tuple[str, bool, str], list[dict[str, float]]] = {}
    try:
        for round_index in range(args.rounds):
            for endpoint, usage in LOADS:
                names = ["base", "this"] if round_index % 2 == 0 else ["this", "base"]
                for name in names:
                    figures.setdefault((endpoint, usage, name), []).append(run_load(workers[name], endpoint, usage))
            print(f"round {round_index + 1} of {args.rounds} done", file=sys.stderr, flush=True)
    finally:
        for proc in workers.values():
            proc.stdin.close()  # type: ignore[union-attr]
            proc.wait(timeout=60)
    print(f"API server CPU us per streamed token (its process, less the scripted engine's building of outputs); "
          f"{args.concurrency} streams x {args.output_len} tokens, a step every {args.step_ms:g} ms, engine in "
          f"{'a process of its own' if args.engine == 'process' else 'the event loop'}, "
          f"{args.rounds} rounds, medians")
    print(f"{'load':34s} {'base':>8s} {'this':>8s} {'this/base':>10s} {'sys base':>9s} {'sys this':>9s} "
          f"{'read base':>10s} {'read this':>10s} {'send base':>10s} {'send this':>10s} {'tok/event':>10s} "
          f"{'built us':>9s} {'tok/s base':>11s} {'tok/s this':>11s}")
    for endpoint, usage in LOADS:
        base, this = figures[(endpoint, usage, "base")], figures[(endpoint, usage, "this")]
        ratios = [t["us_per_token"] / b["us_per_token"] for b, t in zip(base, this, strict=True)]
        name = f"{endpoint}{', include_usage' if usage else ''}"
        per_event = statistics.median(f["tokens_per_event"] for f in base + this)
        built = statistics.median(f["built_us_per_token"] for f in base + this)
        print(f"{name:34s} {statistics.median(f['us_per_token'] for f in base):8.2f} "
              f"{statistics.median(f['us_per_token'] for f in this):8.2f} {statistics.median(ratios):10.3f} "
              f"{statistics.median(f['system_us_per_token'] for f in base):9.2f} "
              f"{statistics.median(f['system_us_per_token'] for f in this):9.2f} "
              f"{statistics.median(f['reader_us_per_token'] for f in base):10.2f} "
              f"{statistics.median(f['reader_us_per_token'] for f in this):10.2f} "
              f"{statistics.median(f['sender_us_per_token'] for f in base):10.2f} "
              f"{statistics.median(f['sender_us_per_token'] for f in this):10.2f} {per_event:10.2f} {built:9.2f} "
              f"{statistics.median(f['tokens_per_second'] for f in base):11.0f} "
              f"{statistics.median(f['tokens_per_second'] for f in this):11.0f}")


if __name__ == "__main__":
    main()
