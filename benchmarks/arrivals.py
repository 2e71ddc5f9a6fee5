"""Arrivals while streams decode, over HTTP on an emulated GPU: prefill calls against prompts fed through the
decode step (``--decoded-prompt-tokens``).

A closed loop of ``--requests`` streamed requests at ``--concurrency`` (``rnnserve bench``, prompts of 16 token
ids, ``--output-len`` new tokens) keeps new prompts arriving while the other streams decode, as ``gpu_bench``'s
HTTP rows do. The server is the real app, its engine in a process of its own with async scheduling, on an
emulated GPU (``async_scheduling.EmulatedDevice``): a decode step's tokens come ``--step-ms`` after it starts,
and a prefill call first keeps the engine busy for ``--prefill-ms`` (on an H100, mamba-370m: a step ~3.5 ms at
batch 256, a prefill call ~35 ms of launches). The settings alternate round by round; the table gives medians,
the rate against the device's alone (``concurrency / step``), time to first token and inter-token latency::

    .venv/bin/python benchmarks/arrivals.py [--step-ms 12] [--prefill-ms 120] [--concurrency 256] [--rounds 3]
"""

from __future__ import annotations

import sys
from pathlib import Path

# Runs from a checkout without installing: rnnserve finds its folders beside rnnserve/.
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import argparse  # noqa: E402
import tempfile  # noqa: E402

import torch  # noqa: E402

from benchmarks.async_scheduling import PRESET, emulated_app  # noqa: E402
from benchmarks.engine_throughput import served_heap  # noqa: E402
from benchmarks.http_stack import bench, median_over_rounds  # noqa: E402
from rnnserve.server.background import serve_in_thread  # noqa: E402


def served(args: argparse.Namespace, decoded_prompt_tokens: int, out: Path) -> dict:
    """``rnnserve bench`` figures against a fresh server whose engine feeds prompts of at most
    ``decoded_prompt_tokens`` through the decode step; every request must succeed."""
    app = emulated_app(args.concurrency, args.step_ms, "on", "on", prefill_ms=args.prefill_ms,
                       decoded_prompt_tokens=decoded_prompt_tokens)  # fmt: skip
    with served_heap(), serve_in_thread(app) as url:  # the heap as `rnnserve serve` freezes it
        bench(url, out, args.concurrency, args.concurrency, 2)  # warm-up: connections, first shapes
        return bench(url, out, args.requests, args.concurrency, args.output_len)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--step-ms", type=float, default=12.0, help="emulated device time per step (default: 12)")
    parser.add_argument("--prefill-ms", type=float, default=120.0,
                        help="emulated host time per prefill call (default: 120)")  # fmt: skip
    parser.add_argument("--concurrency", type=int, default=256, help="concurrent streams (default: 256)")
    parser.add_argument("--requests", type=int, default=1024, help="requests per run (default: 1024)")
    parser.add_argument("--output-len", type=int, default=256, help="new tokens per request (default: 256)")
    parser.add_argument("--decoded-prompt-tokens", type=int, nargs="+", default=[0, 32],
                        help="settings to compare, the first is the baseline (default: 0 32)")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=3, help="rounds over the settings, alternating (default: 3)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    device_rate = args.concurrency / (args.step_ms / 1e3)
    print(f"{PRESET}, emulated device: {args.step_ms:g} ms a step, {args.prefill_ms:g} ms a prefill call; "
          f"{args.requests} requests at concurrency {args.concurrency}, 16 tokens in, {args.output_len} out; the "
          f"device alone {device_rate:.0f} tok/s", flush=True)  # fmt: skip
    runs: dict[int, list[dict]] = {n: [] for n in args.decoded_prompt_tokens}
    with tempfile.TemporaryDirectory() as folder:
        for round_index in range(args.rounds):
            settings = args.decoded_prompt_tokens if round_index % 2 == 0 else args.decoded_prompt_tokens[::-1]
            for setting in settings:
                figures = served(args, setting, Path(folder) / "bench.json")
                runs[setting].append(figures)
                print(f"  round {round_index + 1}, decoded prompt tokens {setting}: "
                      f"{figures['output_throughput']:.0f} tok/s", flush=True)  # fmt: skip

    def median(setting: int, *keys: str) -> float:
        return median_over_rounds(runs[setting], *keys)

    base = median(args.decoded_prompt_tokens[0], "output_throughput")
    print("\n| decoded prompt tokens | HTTP tok/s | vs first | vs device | TTFT mean ms | TTFT p99 ms | ITL p50 ms "
          "| ITL p99 ms |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for setting in args.decoded_prompt_tokens:
        rate = median(setting, "output_throughput")
        print(f"| {setting} | {rate:.0f} | {rate / base:.2f}x | {rate / device_rate:.0%} "
              f"| {median(setting, 'ttft_ms', 'mean'):.0f} | {median(setting, 'ttft_ms', 'p99'):.0f} "
              f"| {median(setting, 'itl_ms', 'p50'):.1f} | {median(setting, 'itl_ms', 'p99'):.1f} |")  # fmt: skip


if __name__ == "__main__":
    main()
