"""Host work per generated token of two checkouts, measured in the same run: this one against ``--base``.

What is timed is the engine process's loop as it serves streams on a GPU, with the device taken out: each
checkout builds ``random:--preset`` whose decode returns prebuilt logits (the host's part of a CUDA-graph replay
is a few calls; the rest of the step is host work), favouring printable ASCII bytes as a byte-level model's text
mostly is, admits ``--batch`` greedy ``DELTA`` streams of one API server, and then runs the checkout's own
``EngineCore`` over its ``ServerLinks`` as ``run_engine_process`` does: ``step(collect=False)``, the outputs of the
requests that progressed (``OutputEncoder``), routed, pickled and written to the server's pipe. The server's end
reads each message and decodes it as an API server's reader thread does (``OutputDecoder``), timed apart.
Columns: each part's median microseconds per generated token (the engine's step, and inside it scheduling, the
model call, sampling and appending the tokens, where the checkout has those methods; collecting the outputs;
posting them), and the median of the paired ratios ``this / base``.

``--tokenizer bpe`` serves the streams' text through a byte-level BPE trained here on a little English text
(what a Hugging Face tokenizer's detokenization costs) instead of the preset's byte tokenizer; either way each
stream's tokens are of printable ASCII text.

Each checkout runs in a worker process of its own that imports from it. The workers take turns, ``--chunk``
steps at a time, the order alternating, so a machine whose speed drifts (these do, by 30% within minutes)
slows both alike and each ratio compares two runs a few milliseconds apart. The fused CPU kernels are off in
both (``RNNSERVE_CPU_KERNELS=0``): the decode they would run is the free one, and the base need not build them.

    python benchmarks/host_ab.py --base ../rnnserve-before [--batch 256] [--chunks 60] [--chunk 20] [--tokenizer bpe]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PROMPT = list(range(1, 17))
# (label, attribute path from the engine, method) of the parts of a step timed where the checkout has them
STEP_PARTS = [("schedule", "scheduler", "schedule"), ("model call", "runner", "decode"),
              ("sample", "", "_sample"), ("append tokens", "scheduler", "postprocess")]  # fmt: skip
ENGLISH = ("The engine steps every stream together, and each token it samples is appended to its stream's text, "
           "which the server sends on as it comes. ") * 40  # fmt: skip


def bpe_tokenizer(vocab_size: int) -> Any:
    """A byte-level BPE of ``vocab_size`` tokens trained on :data:`ENGLISH`, as rnnserve loads a checkpoint's."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from rnnserve.engine.tokenizer import HFTokenizer

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)  # fmt: skip
    tokenizer.train_from_iterator([ENGLISH], trainer)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "tokenizer.json"
        tokenizer.save(str(path))
        return HFTokenizer(path)


def printable_logits(rows: int, vocab: int, tokenizer: Any) -> Any:
    """Prebuilt logits ``[rows, vocab]`` whose argmax in every row is a token of printable ASCII text: each stream's
    text is printable, as English text is (a byte tokenizer's bytes 32-126; a BPE's tokens of such bytes, merges
    included: its other ids of the bytes 32-126 are pieces of characters, a stream of which never decodes)."""
    import torch

    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0))
    printable = [token for token in range(min(vocab, tokenizer.vocab_size))
                 if (text := tokenizer.token_bytes(token)) and all(32 <= byte < 127 for byte in text)]  # fmt: skip
    logits[:, printable] += 8.0
    return logits


def free_decode(logits: Any) -> Callable[..., Any]:
    """A decode that returns the first ``B`` rows of prebuilt logits (what a graph replay leaves the host)."""

    def decode(batch: Any, state: Any) -> Any:
        return logits[: batch.input_ids.shape[0]]

    return decode


def timed_method(owner: object, name: str, totals: dict[str, float], label: str) -> None:
    """Wrap ``owner.name`` so that each call adds its wall time to ``totals[label]``."""
    method = getattr(owner, name)

    def call(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            totals[label] = totals.get(label, 0.0) + time.perf_counter() - start

    setattr(owner, name, call)


def worker(checkout: str, preset: str, batch: int, chunk: int, output_kind: str, tokenizer_kind: str) -> None:
    """Build the engine from ``checkout``; for each line on stdin, run ``chunk`` steps and print the parts'
    microseconds per token as ``label=value`` fields."""
    sys.path.insert(0, checkout)
    import torch

    from rnnserve.engine.config import EngineConfig
    from rnnserve.engine.llm_engine import LLMEngine, freeze_startup_heap
    from rnnserve.engine.loader import build_random
    from rnnserve.engine.sampling_params import OutputKind, SamplingParams
    from rnnserve.server.engine_core import EncodedStep, EngineCore, OutputDecoder, ServerLinks

    imported = Path(sys.modules[LLMEngine.__module__].__file__ or "").resolve()
    if not imported.is_relative_to(Path(checkout).resolve()):
        sys.exit(f"{checkout} is not an rnnserve checkout: the engine came from {imported}")
    torch.set_num_threads(1)
    model, tokenizer = build_random(preset, torch.device("cpu"), torch.float32)
    if tokenizer_kind == "bpe":
        tokenizer = bpe_tokenizer(model.vocab_size)
    config = EngineConfig(max_num_seqs=batch, max_num_batched_tokens=max(2048, len(PROMPT) * batch),
                          enable_prefix_cache=False, async_scheduling="on")  # fmt: skip
    engine = LLMEngine(model, tokenizer, config)
    freeze_startup_heap()
    model.decode = free_decode(printable_logits(batch, model.vocab_size, tokenizer))
    totals: dict[str, float] = {}
    for label, owner, name in [*STEP_PARTS, ("engine step", "", "step"), ("collect", "", "collect")]:
        target = getattr(engine, owner) if owner else engine
        if hasattr(target, name):
            timed_method(target, name, totals, label)
    server_end, engine_end = multiprocessing.Pipe()
    links = ServerLinks([engine_end])
    timed_method(links, "post", totals, "post")
    encoder = {"encoder": links.encoder} if hasattr(links.encoder, "take_deltas") else {}  # columns, where it has them
    core = EngineCore(engine, links.next_command, links.post, links.encoder.row, links, **encoder)
    decoder = OutputDecoder()
    decode = getattr(decoder, "decode_step", None) or (lambda step: decoder.decode(step.rows))
    params = SamplingParams(temperature=0, max_tokens=engine.max_model_len - len(PROMPT), ignore_eos=True,
                            output_kind=OutputKind(output_kind))  # fmt: skip
    for index in range(batch):  # as an API server's ids, owned by it
        request_id = f"cmpl-{index:032x}"
        engine.add_request(PROMPT, params, request_id)
        links.owners[request_id] = 0

    def serve_step() -> tuple[float, float]:
        """One step of the loop and its outputs' way to the server: the loop's seconds and the server's."""
        start = time.perf_counter()
        core._step()
        stepped = time.perf_counter()
        payload = server_end.recv_bytes() if server_end.poll() else None
        decoded = time.perf_counter()
        if payload is not None:
            step = pickle.loads(payload)
            assert isinstance(step, EncodedStep)
            decode(step)
            decoded = time.perf_counter()
            links.unhandled[0] = 0  # handled
        return stepped - start, decoded - stepped if payload is not None else 0.0

    for _ in range(8):  # prefill, then a few decode steps
        serve_step()
    print("ready", flush=True)
    for _ in sys.stdin:
        totals.clear()
        loop = server = 0.0
        for _ in range(chunk):
            loop_seconds, server_seconds = serve_step()
            loop += loop_seconds
            server += server_seconds
            if engine.last_step.decode_batch_size != batch:
                raise RuntimeError(f"a step decoded {engine.last_step.decode_batch_size} streams, not {batch}")
        tokens = chunk * batch
        fields = {f"  {k}": v for k, v in totals.items() if k not in ("engine step", "collect", "post")}
        fields.update({"engine step": totals["engine step"], "collect outputs": totals["collect"],
                       "post (route, pickle, write)": totals["post"], "total": loop,
                       "server: unpickle, decode": server})  # fmt: skip
        print(";".join(f"{k}={v / tokens * 1e6:.5f}" for k, v in fields.items()), flush=True)


def start_worker(checkout: Path, args: argparse.Namespace) -> subprocess.Popen[str]:
    command = [sys.executable, __file__, "--worker", str(checkout), "--preset", args.preset,
               "--batch", str(args.batch), "--chunk", str(args.chunk), "--output-kind", args.output_kind,
               "--tokenizer", args.tokenizer]  # fmt: skip
    env = {**os.environ, "RNNSERVE_CPU_KERNELS": "0", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=checkout)
    assert proc.stdout is not None
    if proc.stdout.readline().strip() != "ready":
        proc.kill()
        raise RuntimeError(f"the worker of {checkout} did not start (see its output above)")
    return proc


def run_chunk(proc: subprocess.Popen[str]) -> dict[str, float]:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write("go\n")
    proc.stdin.flush()
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError("a worker stopped")
    return {key: float(value) for key, value in (field.split("=") for field in line.rstrip("\n").split(";"))}


def compare(base: list[dict[str, float]], this: list[dict[str, float]]) -> list[list[str]]:
    """Rows of the table: each part both checkouts timed, its medians and the median paired ratio."""
    rows = []
    for key in this[0]:
        if key not in base[0]:
            continue
        ratios = [t[key] / b[key] for b, t in zip(base, this, strict=True) if b[key] > 0]
        rows.append([key, f"{statistics.median(b[key] for b in base):.3f}",
                     f"{statistics.median(t[key] for t in this):.3f}", f"{statistics.median(ratios):.3f}"])  # fmt: skip
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", type=Path, help="the checkout to compare this one against")
    parser.add_argument("--preset", default="mingru-tiny", help="random: preset (default: mingru-tiny)")
    parser.add_argument("--batch", type=int, default=256, help="decoding streams (default: 256)")
    parser.add_argument("--chunks", type=int, default=60, help="timed chunks per checkout (default: 60)")
    parser.add_argument("--chunk", type=int, default=20, help="steps per chunk (default: 20)")
    parser.add_argument("--output-kind", choices=["delta", "final_only", "cumulative"], default="delta",
                        help="what each request reads (default: delta, a stream; final_only: the offline engine)")
    parser.add_argument("--tokenizer", choices=["byte", "bpe"], default="byte",
                        help="the streams' tokenizer: the preset's bytes (default) or a byte-level BPE trained here")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker, args.preset, args.batch, args.chunk, args.output_kind, args.tokenizer)
        return
    if args.base is None:
        parser.error("--base is required")
    checkouts = {"base": args.base.resolve(), "this": ROOT}
    procs = {name: start_worker(path, args) for name, path in checkouts.items()}
    results: dict[str, list[dict[str, float]]] = {name: [] for name in procs}
    try:
        for index in range(args.chunks):
            for name in ("base", "this") if index % 2 else ("this", "base"):
                results[name].append(run_chunk(procs[name]))
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait()
    print(f"host us per generated token at batch {args.batch} ({args.preset}, free model step, "
          f"{args.output_kind} outputs, {args.tokenizer} tokenizer), "
          f"{args.chunks} x {args.chunk} steps each, in turns")  # fmt: skip
    print(f"base: {checkouts['base']}\nthis: {checkouts['this']}")
    header = ["part", "base", "this", "this / base"]
    rows = compare(results["base"], results["this"])
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    for row in [header, *rows]:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)))
    print("(this / base: median of the ratios of chunks run in turn)")


if __name__ == "__main__":
    main()
