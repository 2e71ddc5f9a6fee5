"""Async scheduling on an emulated GPU: how close do the engine and the HTTP server come to the device's rate?

On a GPU a decode step's kernels run while the host does its own work. This script gives ``random:mingru-tiny``
(CPU, one thread) such a device: each engine step's sampled tokens become readable ``--step-ms`` after the
device is free to start that step (``EmulatedDevice``; the host waits for them with the GIL released, as a CUDA
sync does). The device alone would deliver ``streams / step-ms``. The engine is run with async scheduling off
(each step waits for its tokens before the host's work starts) and on (the next step is queued first), offline
(``LLMEngine.step`` in a loop) and over HTTP (the real server in this process, its engine in a thread or, with
``engine_process``, in a process of its own; ``rnnserve bench`` in another process), alternating, and the tables
give each rate, its ratios to the offline engine's and the device's, and the serving process's CPU time per
generated token (which, with the engine in a thread, includes the engine's host work)::

    .venv/bin/python benchmarks/async_scheduling.py [--step-ms 5] [--streams 256] [--output-len 64] [--rounds 2]

The model itself still runs on the CPU (a decode step about 1.5 ms at 256 streams), which a GPU host does not pay.
With ``--free-model`` the model's prefill and decode return prebuilt logits instead (favouring printable
ASCII, as a byte-level model's text mostly is), so the host's work is the engine's alone: ``--free-model
--step-ms 0.49`` is a GPU host serving mingru-100m at batch 256, whose engine issue 14 asks to keep within 15%
of the model step.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Runs from a checkout without installing: rnnserve finds its folders beside rnnserve/.
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import argparse  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import resource  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from fastapi import FastAPI  # noqa: E402

from benchmarks.engine_throughput import generated_tokens_per_second, served_heap  # noqa: E402
from benchmarks.host_ab import free_decode, printable_logits  # noqa: E402
from rnnserve.engine.config import EngineConfig  # noqa: E402
from rnnserve.engine.llm_engine import LLMEngine  # noqa: E402
from rnnserve.engine.loader import build_random  # noqa: E402
from rnnserve.engine.sampler import SampledTokens  # noqa: E402
from rnnserve.server.app import ServerConfig, create_app  # noqa: E402
from rnnserve.server.background import serve_in_thread  # noqa: E402

PRESET = "mingru-tiny"
MODES = ("off", "on")
HTTP_CONFIGS = (("off", "off"), ("on", "off"), ("on", "on"))  # (async scheduling, engine process)


SLEEP_SLACK_S = 2e-4  # time.sleep overshoots by ~0.1 ms on these VMs; the rest of a wait yields in a loop


def wait_until(deadline: float) -> None:
    """Return at ``deadline`` (``time.perf_counter``), to within a few microseconds, as a CUDA event's
    synchronize does: sleep most of the way, then yield the CPU (and the GIL) until it is time."""
    left = deadline - time.perf_counter()
    if left > SLEEP_SLACK_S:
        time.sleep(left - SLEEP_SLACK_S)
    while time.perf_counter() < deadline:
        os.sched_yield()


class EmulatedDevice:
    """A device that runs one engine step in ``seconds``, in launch order, while the host goes on: a step's
    tokens are ready ``seconds`` after the later of its launch and the previous step's end. A prefill call
    also keeps the engine's host busy for ``prefill_seconds`` before it returns (a GPU prefill's kernel
    launches: tens of ms for a 48-layer model, whatever the prompts' lengths), as a sleep: on a GPU host the
    engine's process has a core of its own."""

    def __init__(self, seconds: float, prefill_seconds: float = 0.0) -> None:
        self.seconds = seconds
        self.prefill_seconds = prefill_seconds
        self.free_at = 0.0

    def attach(self, engine: LLMEngine) -> LLMEngine:
        """Make ``engine``'s sampled tokens wait for this device, and its prefill calls for their launches."""
        sample = engine._sample
        prefill = engine.runner.prefill

        def launched_prefill(*args):  # type: ignore[no-untyped-def]
            time.sleep(self.prefill_seconds)
            return prefill(*args)

        if self.prefill_seconds:
            engine.runner.prefill = launched_prefill  # type: ignore[method-assign]

        def queued_sample(*args):  # type: ignore[no-untyped-def]
            sampled: SampledTokens = sample(*args)
            ready = max(time.perf_counter(), self.free_at) + self.seconds
            self.free_at = ready
            result = sampled.result

            def wait_then_result():  # type: ignore[no-untyped-def]
                wait_until(ready)
                return result()

            sampled.result = wait_then_result  # type: ignore[method-assign]
            return sampled

        engine._sample = queued_sample  # type: ignore[method-assign]
        return engine


def make_model_free(engine: LLMEngine) -> LLMEngine:
    """Replace ``engine``'s model calls by rows of prebuilt logits whose argmax is a printable byte: the host's
    part of a CUDA-graph replay or of a small prefill is a few calls, so what remains is the engine's host work.
    """
    model = engine.runner.model
    rows = engine.config.max_num_seqs
    logits = printable_logits(rows, model.vocab_size, engine.tokenizer)

    def prefill(batch, state):  # type: ignore[no-untyped-def]
        return logits[torch.arange(batch.logit_rows.shape[0]) % rows]

    model.decode = free_decode(logits)  # type: ignore[method-assign]
    model.prefill = prefill  # type: ignore[method-assign]
    return engine


def offline_run(args: argparse.Namespace, mode: str) -> float:
    """Generated tok/s of ``LLMEngine.step`` in a loop over ``--streams`` requests."""
    model, tokenizer = build_random(PRESET, torch.device("cpu"), torch.float32)
    config = EngineConfig(max_num_seqs=args.streams, max_num_batched_tokens=16 * args.streams, async_scheduling=mode)
    engine = EmulatedDevice(args.step_ms / 1e3).attach(LLMEngine(model, tokenizer, config))
    if args.free_model:
        make_model_free(engine)
    with served_heap():
        generated_tokens_per_second(engine, 4, 16, 4)
        return generated_tokens_per_second(engine, args.streams, 16, args.output_len)


def emulated_engine(
    step_ms: float, config: EngineConfig, prefill_ms: float = 0.0, free_model: bool = False
) -> LLMEngine:
    """The engine factory of the server's engine process: one torch thread, its steps on an emulated device
    (:class:`EmulatedDevice`), its model calls free with ``free_model`` (:func:`make_model_free`)."""
    torch.set_num_threads(1)
    engine = EmulatedDevice(step_ms / 1e3, prefill_ms / 1e3).attach(LLMEngine.from_config(config))
    return make_model_free(engine) if free_model else engine


def cpu_seconds_while(command: list[str]) -> float:
    """Run ``command`` (``PYTHONPATH`` set to this checkout); this process's CPU seconds meanwhile."""
    before = resource.getrusage(resource.RUSAGE_SELF)
    subprocess.run(command, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, check=True)
    after = resource.getrusage(resource.RUSAGE_SELF)
    return after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime


def bench_figures(
    url: str, out: Path, requests: int, concurrency: int, output_len: int, processes: int = 1
) -> dict:
    """``rnnserve bench`` (another process, or ``processes`` of them; prompts of 16 token ids) against ``url``:
    its figures, and as ``cpu_s`` this process's CPU seconds (the server's, when it serves in this process)
    meanwhile."""
    command = [sys.executable, "-c", "import sys; from rnnserve.server.cli import main; sys.exit(main())",
               "bench", "--url", url, "--num-prompts", str(requests), "--concurrency", str(concurrency),
               "--input-len", "16", "--output-len", str(output_len), "--prompts", "ids", "--no-progress",
               "--processes", str(processes), "--json", str(out)]  # fmt: skip
    cpu_s = cpu_seconds_while(command)
    return {**json.loads(out.read_text()), "cpu_s": cpu_s}


def emulated_app(
    streams: int,
    step_ms: float,
    async_scheduling: str,
    engine_process: str,
    prefill_ms: float = 0.0,
    free_model: bool = False,
    **engine: Any,
) -> FastAPI:
    """The real app over :func:`emulated_engine` with ``streams`` slots, its engine in a thread or a process;
    ``engine``: more engine options (``EngineConfig`` fields)."""
    config = ServerConfig.build(model=f"random:{PRESET}", max_num_seqs=streams, max_prompt_tokens=64, api_key=None,
                                async_scheduling=async_scheduling, engine_process=engine_process, **engine)  # fmt: skip
    return create_app(config, engine_factory=functools.partial(emulated_engine, step_ms, prefill_ms=prefill_ms,
                                                                  free_model=free_model))


def http_run(args: argparse.Namespace, mode: str, engine_process: str, out: Path) -> dict:
    """``rnnserve bench`` figures against a fresh in-process server, its engine in a thread or a process."""
    app = emulated_app(args.streams, args.step_ms, mode, engine_process, free_model=args.free_model)
    with served_heap(), serve_in_thread(app) as url:  # the heap as `rnnserve serve` freezes it
        figures = bench_figures(url, out, 2 * args.streams, args.streams, args.output_len)
    figures["server_cpu_us_per_token"] = figures["cpu_s"] / figures["total_output_tokens"] * 1e6
    return figures


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--step-ms", type=float, default=5.0, help="emulated device time per step (default: 5)")
    parser.add_argument("--streams", type=int, default=256, help="concurrent streams (default: 256)")
    parser.add_argument("--output-len", type=int, default=64, help="new tokens per request (default: 64)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of off/on, alternating (default: 2)")
    parser.add_argument("--no-http", action="store_true", help="offline rows only")
    parser.add_argument("--free-model", action="store_true", help="the model returns prebuilt logits (no CPU model)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # the engine thread's own work, as on a GPU host; the other core runs the client
    device_rate = args.streams / (args.step_ms / 1e3)
    model = "free model" if args.free_model else PRESET
    print(f"{model}, {args.step_ms:g} ms emulated device step, {args.streams} streams, {args.output_len} new "
          f"tokens: the device alone {device_rate:.0f} tok/s", flush=True)
    offline: dict[str, list[float]] = {m: [] for m in MODES}
    http: dict[tuple[str, str], list[dict]] = {c: [] for c in HTTP_CONFIGS}
    with tempfile.TemporaryDirectory() as folder:
        for round_index in range(args.rounds):
            for mode in MODES if round_index % 2 == 0 else MODES[::-1]:
                offline[mode].append(offline_run(args, mode))
                print(f"  round {round_index + 1}, async scheduling {mode}: offline {offline[mode][-1]:.0f} tok/s",
                      flush=True)  # fmt: skip
            for mode, engine_process in HTTP_CONFIGS if round_index % 2 == 0 else HTTP_CONFIGS[::-1]:
                if args.no_http:
                    break
                figures = http_run(args, mode, engine_process, Path(folder) / "bench.json")
                http[mode, engine_process].append(figures)
                print(f"  round {round_index + 1}, async scheduling {mode}, engine process {engine_process}: HTTP "
                      f"{figures['output_throughput']:.0f} tok/s ({figures['failed']} failed)", flush=True)  # fmt: skip
    print("\n| async scheduling | offline tok/s | offline / device |")
    print("|---|---:|---:|")
    rates = {mode: statistics.median(offline[mode]) for mode in MODES}
    for mode in MODES:
        print(f"| {mode} | {rates[mode]:.0f} | {rates[mode] / device_rate:.0%} |")
    if args.no_http:
        return
    print("\n| async scheduling | engine process | HTTP tok/s | HTTP / offline | HTTP / device | ITL p50 ms "
          "| server process CPU us/token |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for mode, engine_process in HTTP_CONFIGS:
        served = statistics.median(r["output_throughput"] for r in http[mode, engine_process])
        itl = statistics.median(r["itl_ms"]["p50"] for r in http[mode, engine_process])
        cpu = statistics.median(r["server_cpu_us_per_token"] for r in http[mode, engine_process])
        print(f"| {mode} | {engine_process} | {served:.0f} | {served / rates[mode]:.0%} | {served / device_rate:.0%} "
              f"| {itl:.1f} | {cpu:.1f} |")  # fmt: skip

if __name__ == "__main__":
    main()
