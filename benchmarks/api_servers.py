"""HTTP with one and with several API server processes (``--api-servers``) in front of one engine process, on an
emulated GPU.

The real server processes (``APIServers``, as ``rnnserve serve --api-servers N`` starts them) serve a closed loop
of ``--requests`` streamed requests at ``--concurrency`` (``rnnserve bench`` in ``--client-processes``
processes, prompts of 16 token ids, ``--output-len`` new tokens each). The engine process runs on an emulated
device (``async_scheduling.EmulatedDevice``): a decode step's tokens come ``--step-ms`` after it starts, a prefill
call keeps the engine busy ``--prefill-ms`` (on an H100, mamba-370m: ~3.5 ms a step at batch 256, ~35 ms a
prefill call); the model itself runs on the CPU. The settings alternate round by round; the table gives
medians, with each process's busy cores. It needs a core per busy process to say what a GPU host would see (a
2-core VM can only compare)::

    .venv/bin/python benchmarks/api_servers.py [--api-servers 1 2] [--step-ms 12] [--concurrency 256] [--rounds 3]
"""

from __future__ import annotations

import sys
from pathlib import Path

# Runs from a checkout without installing: rnnserve finds its folders beside rnnserve/.
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import argparse  # noqa: E402
import functools  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import httpx  # noqa: E402

from benchmarks.async_scheduling import PRESET, emulated_engine  # noqa: E402
from benchmarks.gpu_bench import cpu_seconds  # noqa: E402
from benchmarks.http_stack import bench, median_over_rounds  # noqa: E402
from rnnserve.server.api_servers import APIServers  # noqa: E402
from rnnserve.server.config import ServerConfig  # noqa: E402
from rnnserve.server.http_server import listen_socket  # noqa: E402


def ready(url: str) -> bool:
    """Whether a server answers ``/ready`` with 200 (connections are refused until the first one listens)."""
    try:
        return httpx.get(f"{url}/ready", timeout=5).status_code == 200
    except httpx.ConnectError:
        return False


def served(args: argparse.Namespace, api_servers: int, out: Path) -> dict:
    """The client's figures against ``api_servers`` fresh server processes, with the cores each server process
    and the engine process kept busy during the timed run."""
    sock = listen_socket("127.0.0.1", 0, reuse_port=True)
    port = sock.getsockname()[1]
    config = ServerConfig.build(model=f"random:{PRESET}", max_num_seqs=args.concurrency, max_prompt_tokens=64,
                                api_key=None, sessions=False, engine_process="on", async_scheduling="on", device="cpu",
                                api_servers=api_servers, port=port, log_level="warning")  # fmt: skip
    servers = APIServers(config, sock, functools.partial(emulated_engine, args.step_ms, prefill_ms=args.prefill_ms))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while not ready(url):
            if time.monotonic() > deadline:
                raise RuntimeError("the servers did not get ready")
            time.sleep(0.2)
        # Warm-up: every server process up, the first shapes.
        bench(url, out, args.concurrency, args.concurrency, 2, args.client_processes)
        pids = [server.pid or 0 for server in servers.servers] + [servers.engine.process.pid or 0]
        before = [cpu_seconds(pid) for pid in pids]
        figures = bench(url, out, args.requests, args.concurrency, args.output_len, args.client_processes)
        busy = [(cpu_seconds(pid) - start) / figures["duration_s"] for pid, start in zip(pids, before, strict=True)]
    finally:
        servers.stop()
        servers.wait()
        sock.close()
    return {**figures, "server_cores": busy[:-1], "engine_cores": busy[-1]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--api-servers", type=int, nargs="+", default=[1, 2],
                        help="settings to compare, the first is the baseline (default: 1 2)")  # fmt: skip
    parser.add_argument("--step-ms", type=float, default=12.0, help="emulated device time per step (default: 12)")
    parser.add_argument("--prefill-ms", type=float, default=0.0,
                        help="emulated host time per prefill call (default: 0)")  # fmt: skip
    parser.add_argument("--concurrency", type=int, default=256, help="concurrent streams (default: 256)")
    parser.add_argument("--requests", type=int, default=1024, help="requests per run (default: 1024)")
    parser.add_argument("--output-len", type=int, default=64, help="new tokens per request (default: 64)")
    parser.add_argument("--client-processes", type=int, default=1, help="rnnserve bench --processes (default: 1)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds over the settings, alternating (default: 3)")
    args = parser.parse_args(argv)
    device_rate = args.concurrency / (args.step_ms / 1e3)
    print(f"{PRESET}, emulated device: {args.step_ms:g} ms a step, {args.prefill_ms:g} ms a prefill call; "
          f"{args.requests} requests at concurrency {args.concurrency}, 16 tokens in, {args.output_len} out; the "
          f"device alone {device_rate:.0f} tok/s; {os.cpu_count()} CPUs", flush=True)  # fmt: skip
    runs: dict[int, list[dict]] = {n: [] for n in args.api_servers}
    with tempfile.TemporaryDirectory() as folder:
        for round_index in range(args.rounds):
            for setting in args.api_servers if round_index % 2 == 0 else args.api_servers[::-1]:
                figures = served(args, setting, Path(folder) / "bench.json")
                runs[setting].append(figures)
                print(f"  round {round_index + 1}, {setting} API servers: {figures['output_throughput']:.0f} tok/s, "
                      f"{figures['request_throughput']:.1f} req/s", flush=True)  # fmt: skip

    def median(setting: int, *keys: str) -> float:
        return median_over_rounds(runs[setting], *keys)

    base = median(args.api_servers[0], "output_throughput")
    print("\n| API servers | HTTP tok/s | vs first | vs device | req/s | TTFT mean ms | ITL p50 ms | server cores "
          "(each) | engine cores |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|---:|---|---:|")
    for setting in args.api_servers:
        rate = median(setting, "output_throughput")
        cores = " + ".join(f"{statistics.median(f['server_cores'][i] for f in runs[setting]):.2f}"
                           for i in range(setting))  # fmt: skip
        engine = median(setting, "engine_cores")
        print(f"| {setting} | {rate:.0f} | {rate / base:.2f}x | {rate / device_rate:.0%} "
              f"| {median(setting, 'request_throughput'):.1f} | {median(setting, 'ttft_ms', 'mean'):.0f} "
              f"| {median(setting, 'itl_ms', 'p50'):.1f} | {cores} | {engine:.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
