"""What serving over HTTP costs on CPU: ``rnnserve serve`` under ``rnnserve bench`` against the same load run
offline through the engine, in the same run (issue 18: >= 90% of offline at 32 streams).

For each dtype, one ``rnnserve serve`` process and one offline worker process (the engine alone, driven like
``rnnserve bench --concurrency`` drives the server: a new request starts when one finishes, prefill included)
load the same seeded ``random:<preset>`` checkpoint, written once with token-id prompts. Each round runs the
same prompts through both, in alternating order, so drift of the machine hits both; the table gives medians,
their ratio, and CPU per generated token: the whole server, its event-loop thread alone, the offline worker, and
the load generator (this process), which shares the cores with the server.
Both processes get the same environment (``OMP_NUM_THREADS`` from ``--threads``; ``OMP_WAIT_POLICY`` /
``GOMP_SPINCOUNT`` as set for this script, else what ``rnnserve serve`` chooses, passed to both so they run the
same OpenMP policy)::

    .venv/bin/python benchmarks/http_overhead.py                        # fp32 and bf16, 1 and 32 streams
    .venv/bin/python benchmarks/http_overhead.py --dtypes float32 --streams 32 --rounds 5
    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/http_overhead.py   # no spinning, both sides
"""

from __future__ import annotations

import sys
from pathlib import Path

# Runs from a checkout without installing: rnnserve finds its folders beside rnnserve/.
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from benchmarks.cpu_peers import CLI, Server, engine_served_rate, free_port, markdown_table, token_prompts
from rnnserve.clients.bench import BenchConfig, benchmark
from rnnserve.engine.config import EngineConfig
from rnnserve.engine.llm_engine import LLMEngine
from rnnserve.engine.loader import build_random, save_checkpoint
from rnnserve.server.cli import serving_environment

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def write_checkpoint(preset: str, seed: int, out: Path) -> int:
    """``random:<preset>`` (fp32, ``seed``) as a checkpoint whose prompts are token ids; returns the vocab size."""
    model, _ = build_random(preset, torch.device("cpu"), torch.float32, seed=seed)
    save_checkpoint(model, out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "tokenizer": "token_ids"}, indent=2) + "\n")
    return model.vocab_size


def worker(model_dir: str, dtype: str, max_num_seqs: int) -> None:
    """The offline side: one JSON request per stdin line (prompts, new tokens, concurrency), one tok/s per line."""
    config = EngineConfig(model=model_dir, device="cpu", dtype=dtype, max_num_seqs=max_num_seqs)
    engine = LLMEngine.from_config(config)
    print("ready", flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        print(engine_served_rate(engine, job["prompts"], job["new_tokens"], job["concurrency"]), flush=True)


def cpu_seconds(pid: int, main_thread_only: bool = False) -> float:
    """CPU seconds (user + system) so far of every thread of ``pid``, or of its main thread only."""
    stat = Path(f"/proc/{pid}/task/{pid}/stat" if main_thread_only else f"/proc/{pid}/stat")
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


@dataclass
class Sample:
    rate: float  # output tok/s
    cpu_per_token_ms: float
    loop_per_token_ms: float | None = None  # the server's event-loop thread (its main thread)
    client_per_token_ms: float | None = None  # the load generator (this process), on the same cores


class OfflineWorker:
    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc

    def run(self, prompts: list[list[int]], new_tokens: int, concurrency: int) -> Sample:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        before = cpu_seconds(self.proc.pid)
        job = {"prompts": prompts, "new_tokens": new_tokens, "concurrency": concurrency}
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        rate = float(self.proc.stdout.readline())
        tokens = len(prompts) * new_tokens
        return Sample(rate, 1000 * (cpu_seconds(self.proc.pid) - before) / tokens)


@contextmanager
def offline_worker(model_dir: Path, dtype: str, slots: int, env: dict[str, str]) -> Iterator[OfflineWorker]:
    command = [sys.executable, __file__, "--worker", str(model_dir), dtype, str(slots)]
    proc = subprocess.Popen(command, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        if proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the offline worker for {dtype} did not start")
        yield OfflineWorker(proc)
    finally:
        proc.kill()
        proc.wait()


class HttpServer:
    def __init__(self, proc: subprocess.Popen, url: str) -> None:
        self.proc = proc
        self.url = url

    def run(self, config: BenchConfig) -> Sample:
        pid = self.proc.pid
        before, loop_before = cpu_seconds(pid), cpu_seconds(pid, main_thread_only=True)
        client_before = time.process_time()
        figures = asyncio.run(benchmark(config))
        client = time.process_time() - client_before
        if figures["failed"]:
            raise RuntimeError(f"{figures['failed']} requests failed: {figures['failures']}")
        tokens = figures["total_output_tokens"]
        return Sample(
            figures["output_throughput"],
            1000 * (cpu_seconds(pid) - before) / tokens,
            1000 * (cpu_seconds(pid, main_thread_only=True) - loop_before) / tokens,
            1000 * client / tokens,
        )


@contextmanager
def http_server(model_dir: Path, dtype: str, slots: int, env: dict[str, str], log: Path) -> Iterator[HttpServer]:
    port = free_port()
    command = [sys.executable, "-c", CLI, "serve", "--model", str(model_dir), "--dtype", dtype, "--host", "127.0.0.1",
               "--port", str(port), "--max-num-seqs", str(slots), "--log-level", "warning"]  # fmt: skip
    with Server(f"rnnserve serve ({dtype})", command, port, log, env) as served:
        assert served.process is not None
        yield HttpServer(served.process, served.url)


def median(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def fmt(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def measure(args: argparse.Namespace, model_dir: Path, vocab_size: int, dtype: str, env: dict[str, str],
            logs: Path) -> list[list[str]]:
    slots = max(args.streams)
    rows = []
    with http_server(model_dir, dtype, slots, env, logs / f"serve-{dtype}.log") as http, \
            offline_worker(model_dir, dtype, slots, env) as offline:
        for streams in args.streams:
            count = max(4, 2 * streams)
            runs: dict[str, list[Sample]] = {"offline": [], "http": []}
            for round_index in range(args.warmup + args.rounds):
                seed = 1000 * streams + round_index
                prompts = token_prompts(count, args.prompt_len, vocab_size, seed)
                config = BenchConfig(url=http.url, num_prompts=count, concurrency=streams, input_len=args.prompt_len,
                                     output_len=args.output_len, seed=seed, progress=False, prompts="ids",
                                     max_token_id=vocab_size)
                order = ["offline", "http"] if round_index % 2 == 0 else ["http", "offline"]
                for side in order:
                    sample = (offline.run(prompts, args.output_len, streams) if side == "offline"
                              else http.run(config))
                    if round_index >= args.warmup:
                        runs[side].append(sample)
                print(f"  {dtype} {streams} streams, round {round_index + 1 - args.warmup}: offline "
                      f"{runs['offline'][-1].rate if runs['offline'] else float('nan'):.1f}, HTTP "
                      f"{runs['http'][-1].rate if runs['http'] else float('nan'):.1f} tok/s "
                      f"(load {os.getloadavg()[0]:.1f})" if round_index >= args.warmup else
                      f"  {dtype} {streams} streams: warm-up round done", flush=True)
            offline_rate = median([s.rate for s in runs["offline"]])
            http_rate = median([s.rate for s in runs["http"]])
            rows.append([
                dtype, str(streams), fmt(offline_rate), fmt(http_rate),
                f"{http_rate / offline_rate:.0%}" if offline_rate and http_rate else "n/a",
                fmt(median([s.cpu_per_token_ms for s in runs["offline"]]), 2),
                fmt(median([s.cpu_per_token_ms for s in runs["http"]]), 2),
                fmt(median([s.loop_per_token_ms for s in runs["http"]]), 3),
                fmt(median([s.client_per_token_ms for s in runs["http"]]), 3),
            ])
    return rows


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="mamba-130m", help="random: preset (default: mamba-130m)")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], help="(default: float32 bfloat16)")
    parser.add_argument("--streams", nargs="+", type=int, default=[1, 32], help="concurrent streams (default: 1 32)")
    parser.add_argument("--prompt-len", type=int, default=64, help="prompt tokens (default: 64)")
    parser.add_argument("--output-len", type=int, default=64, help="new tokens per request (default: 64)")
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds, alternating order (default: 3)")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured rounds first (default: 1)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="OMP_NUM_THREADS for both sides")
    parser.add_argument("--seed", type=int, default=0, help="weights seed (default: 0)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    env = serving_environment({**os.environ, "OMP_NUM_THREADS": str(args.threads)})
    policy = ", ".join(f"{k}={env[k]}" for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT") if k in env)
    rows = []
    with tempfile.TemporaryDirectory(prefix="http-overhead-") as tmp:
        work = Path(tmp)
        model_dir = work / "model"
        vocab_size = write_checkpoint(args.preset, args.seed, model_dir)
        print(f"random:{args.preset}, {args.threads} threads, {policy}, prompts of {args.prompt_len} "
              f"token ids, {args.output_len} new tokens, 2 x streams requests per run (at least 4), "
              f"load average {os.getloadavg()[0]:.1f}", flush=True)
        for dtype in args.dtypes:
            rows += measure(args, model_dir, vocab_size, dtype, env, work)
    header = ["dtype", "streams", "offline tok/s", "HTTP tok/s", "HTTP / offline", "offline CPU ms/tok",
              "server CPU ms/tok", "event loop CPU ms/tok", "bench client CPU ms/tok"]
    print(f"\nmedians of {args.rounds} rounds; load average at the end {os.getloadavg()[0]:.1f}\n")
    print(markdown_table(header, rows))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        main()
