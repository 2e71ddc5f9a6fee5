"""A GPU server's HTTP path, emulated on CPU: does the event loop stream while the device computes?

On a GPU the engine thread launches a step and then waits, GIL released, for the device at sampling's
device-to-host copy. This script gives ``random:mingru-tiny`` on one CPU thread such a wait (``--step-ms``,
slept inside sampling) and serves it through the real server (``serve_in_thread``) under ``rnnserve bench``
in a separate process, with the bridge's ``overlap_outputs`` off (a step's outputs go to the event loop when
the step ends) and on (during the next step, after its model call: the default on GPUs), alternating, and
prints HTTP tok/s, its ratio to the same engine offline, and the median inter-token latency::

    .venv/bin/python benchmarks/http_overlap.py [--step-ms 20] [--streams 256] [--output-len 64] [--rounds 2]
"""

from __future__ import annotations

import sys
from pathlib import Path

# Runs from a checkout without installing: rnnserve finds its folders beside rnnserve/.
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from benchmarks.engine_throughput import generated_tokens_per_second  # noqa: E402
from rnnserve.engine.config import EngineConfig  # noqa: E402
from rnnserve.engine.llm_engine import LLMEngine  # noqa: E402
from rnnserve.engine.loader import build_random  # noqa: E402
from rnnserve.server.app import ServerConfig, create_app  # noqa: E402
from rnnserve.server.background import serve_in_thread  # noqa: E402

PRESET = "random:mingru-tiny"


def with_device_wait(engine: LLMEngine, seconds: float) -> LLMEngine:
    """Make ``engine``'s sampling first wait ``seconds`` with the GIL released, like a CUDA sync."""
    sample = engine._sample

    def waiting_sample(*args):  # type: ignore[no-untyped-def]
        time.sleep(seconds)
        return sample(*args)

    engine._sample = waiting_sample  # type: ignore[method-assign]
    return engine


def http_run(args: argparse.Namespace, overlap: bool, out: Path) -> dict:
    """``rnnserve bench`` figures against a fresh in-process server with ``overlap_outputs`` set."""
    app = create_app(ServerConfig.build(model=PRESET, max_num_seqs=args.streams, max_prompt_tokens=64, api_key=None))
    app.state.engine.overlap_outputs = overlap
    with_device_wait(app.state.engine.engine, args.step_ms / 1e3)
    with serve_in_thread(app) as url:
        command = [sys.executable, "-c", "import sys; from rnnserve.server.cli import main; sys.exit(main())",
                   "bench", "--url", url, "--num-prompts", str(2 * args.streams), "--concurrency", str(args.streams),
                   "--input-len", "16", "--output-len", str(args.output_len), "--prompts", "ids", "--no-progress",
                   "--json", str(out)]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        subprocess.run(command, env=env, capture_output=True, check=True)
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--step-ms", type=float, default=20.0, help="emulated device time per step (default: 20)")
    parser.add_argument("--streams", type=int, default=256, help="concurrent streams (default: 256)")
    parser.add_argument("--output-len", type=int, default=64, help="new tokens per request (default: 64)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of off/on, alternating (default: 2)")
    args = parser.parse_args()
    torch.set_num_threads(1)  # the engine thread's own work, as on a GPU host; the other core runs the client
    model, tokenizer = build_random(PRESET.removeprefix("random:"), torch.device("cpu"), torch.float32)
    engine = with_device_wait(LLMEngine(model, tokenizer, EngineConfig(max_num_seqs=args.streams)), args.step_ms / 1e3)
    generated_tokens_per_second(engine, 4, 16, 4)
    offline = generated_tokens_per_second(engine, args.streams, 16, args.output_len)
    del engine
    print(f"mingru-tiny, {args.step_ms:g} ms emulated device step, {args.streams} streams, {args.output_len} new "
          f"tokens: offline {offline:.0f} tok/s", flush=True)
    results: dict[bool, list[dict]] = {False: [], True: []}
    with tempfile.TemporaryDirectory() as folder:
        for round_index in range(args.rounds):
            for overlap in (False, True) if round_index % 2 == 0 else (True, False):
                figures = http_run(args, overlap, Path(folder) / "bench.json")
                results[overlap].append(figures)
                print(f"  round {round_index + 1}, overlap {'on' if overlap else 'off'}: "
                      f"{figures['output_throughput']:.0f} tok/s, failed {figures['failed']}", flush=True)
    print("\n| overlap_outputs | HTTP tok/s (median) | HTTP / offline | ITL p50 ms | offline step ms |")
    print("|---|---:|---:|---:|---:|")
    for overlap, runs in results.items():
        rate = statistics.median(r["output_throughput"] for r in runs)
        itl = statistics.median(r["itl_ms"]["p50"] for r in runs)
        print(f"| {'on' if overlap else 'off'} | {rate:.0f} | {rate / offline:.0%} | {itl:.1f} | "
              f"{1e3 * args.streams / offline:.1f} |")


if __name__ == "__main__":
    main()
