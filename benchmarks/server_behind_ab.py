"""The engine process's loop per streamed token with several API servers, one of them behind, for two checkouts
in the same run: this one against ``--base``.

Each checkout runs ``host_ab.py``'s setup in a worker process of its own (``random:mingru-tiny`` with a free decode
of printable tokens, ``--batch`` greedy ``DELTA`` streams, async scheduling on, the fused CPU kernels off), its
streams spread over ``--servers`` API servers' pipes (``ServerLinks``), and steps its ``EngineCore``; each server
reads and decodes its messages after every step, and, in turn, one server at a time holds what it read for
``--hold`` steps before it says it handled it: its window is then full at the next collection (``wanted`` refuses
its requests). ``--hold 0``: every server keeps up. The workers take turns, ``--chunk`` steps at a time, the order
alternating; printed: the share of collections with a server behind, each checkout's median loop microseconds per
generated token (the loop's ``_step``: step, collect, post) and the median of the paired ratios ``this / base``.

    python benchmarks/server_behind_ab.py --base ../rnnserve-before [--hold 2] [--servers 4] [--chunks 12]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import pickle
import statistics
import subprocess
import sys
import time
from pathlib import Path


def worker(checkout: str, batch: int, chunk: int, servers: int, hold: int) -> None:
    """Build the engine and the servers' links from ``checkout``; for each line on stdin, run ``chunk`` steps and
    print the loop's microseconds per token and the share of collections with a server behind."""
    sys.path.insert(0, checkout)
    import torch

    from benchmarks.host_ab import PROMPT, free_decode, printable_logits
    from rnnserve.engine.config import EngineConfig
    from rnnserve.engine.llm_engine import LLMEngine, freeze_startup_heap
    from rnnserve.engine.loader import build_random
    from rnnserve.engine.sampling_params import OutputKind, SamplingParams
    from rnnserve.server.engine_core import EncodedStep, EngineCore, OutputDecoder, ServerLinks

    imported = Path(sys.modules[LLMEngine.__module__].__file__ or "").resolve()
    if not imported.is_relative_to(Path(checkout).resolve()):
        sys.exit(f"{checkout} is not an rnnserve checkout: the engine came from {imported}")
    torch.set_num_threads(1)
    model, tokenizer = build_random("mingru-tiny", torch.device("cpu"), torch.float32)
    config = EngineConfig(max_num_seqs=batch, max_num_batched_tokens=max(2048, len(PROMPT) * batch),
                          enable_prefix_cache=False, async_scheduling="on")  # fmt: skip
    engine = LLMEngine(model, tokenizer, config)
    freeze_startup_heap()
    model.decode = free_decode(printable_logits(batch, model.vocab_size, tokenizer))
    pipes = [multiprocessing.Pipe() for _ in range(servers)]
    links = ServerLinks([engine_end for _, engine_end in pipes])
    core = EngineCore(engine, links.next_command, links.post, links.encoder.row, links, encoder=links.encoder)
    decoders = [OutputDecoder() for _ in pipes]
    params = SamplingParams(temperature=0, max_tokens=engine.max_model_len - len(PROMPT), ignore_eos=True,
                            output_kind=OutputKind.DELTA)  # fmt: skip
    for index in range(batch):
        request_id = f"cmpl-{index:032x}"
        engine.add_request(PROMPT, params, request_id)
        links.owners[request_id] = index % servers
    held = [0] * servers  # messages each server read and has not said it handled
    steps = 0

    def serve_step() -> tuple[float, bool]:
        """One step of the loop (its seconds, and whether a server was behind), then each server's reading."""
        nonlocal steps
        behind = links.has_room() and links.wanted() is not None
        start = time.perf_counter()
        core._step()
        seconds = time.perf_counter() - start
        holder = (steps // (hold + 1)) % servers if hold and steps % (hold + 1) < hold else None
        steps += 1
        for index, (server_end, _) in enumerate(pipes):
            while server_end.poll():
                message = pickle.loads(server_end.recv_bytes())
                if isinstance(message, EncodedStep):
                    decoders[index].decode_step(message)
                    held[index] += 1
            if index != holder:
                links.unhandled[index] -= held[index]
                held[index] = 0
        return seconds, behind

    for _ in range(8):  # prefill, then a few decode steps
        serve_step()
    print("ready", flush=True)
    for _ in sys.stdin:
        results = [serve_step() for _ in range(chunk)]
        loop = sum(seconds for seconds, _ in results)
        behind = sum(was_behind for _, was_behind in results) / chunk
        print(f"{loop / (chunk * batch) * 1e6:.5f} {behind:.4f}", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", type=Path, required=True, help="the checkout to compare against")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--servers", type=int, default=4)
    parser.add_argument("--hold", type=int, default=2, help="steps a server behind holds its messages (0: none)")
    parser.add_argument("--chunks", type=int, default=12)
    parser.add_argument("--chunk", type=int, default=20, help="steps per turn")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker, args.batch, args.chunk, args.servers, args.hold)
        return
    env = {**os.environ, "RNNSERVE_CPU_KERNELS": "0", "OMP_NUM_THREADS": "1"}
    procs = {}
    for name, checkout in (("this", Path(__file__).resolve().parents[1]), ("base", args.base.resolve())):
        command = [sys.executable, str(Path(__file__).resolve()), "--worker", str(checkout), "--batch",
                   str(args.batch), "--chunk", str(args.chunk), "--servers", str(args.servers), "--hold",
                   str(args.hold), "--base", str(args.base)]  # fmt: skip
        proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                env={**env, "PYTHONPATH": str(checkout)}, cwd=checkout)  # fmt: skip
        assert proc.stdout is not None
        if proc.stdout.readline().strip() != "ready":
            proc.kill()
            raise RuntimeError(f"the worker of {checkout} did not start (see its output above)")
        procs[name] = proc
    micros: dict[str, list[float]] = {"this": [], "base": []}
    behind: list[float] = []
    for chunk_index in range(args.chunks):
        for name in ("this", "base") if chunk_index % 2 == 0 else ("base", "this"):
            proc = procs[name]
            assert proc.stdin is not None and proc.stdout is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
            us, share = proc.stdout.readline().split()
            micros[name].append(float(us))
            if name == "this":
                behind.append(float(share))
    for proc in procs.values():
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait()
    ratios = [this / base for this, base in zip(micros["this"], micros["base"], strict=True)]
    quartiles = statistics.quantiles(ratios, n=4)
    print(f"hold {args.hold}, {args.servers} servers: collections with a server behind {statistics.median(behind):.0%};"
          f" loop us/token this {statistics.median(micros['this']):.3f}, base {statistics.median(micros['base']):.3f};"
          f" this / base {statistics.median(ratios):.2f} (quartiles {quartiles[0]:.2f}-{quartiles[2]:.2f})")


if __name__ == "__main__":
    main()
