"""Host loop: how close ``engine.step()`` comes to the model step it wraps, at a large decode batch.

For each preset, ``--batch`` greedy requests are prefilled, then ``--steps`` engine steps that decode all of them
are timed, once per output kind (``final_only``: what ``LLM.generate`` and a non-streamed response read;
``delta``: what a stream reads; ``cumulative``: every step's whole text). The baseline, measured in the same run
and interleaved with them, is the model step alone: one decode of the same batch on a prebuilt input (a CUDA
graph replay on a GPU). ``engine / model`` is the ratio of the two (the issue's target: at most 1.15 at batch 256);
``host ms`` is what the engine adds per step: scheduling, input building, sampling, token bookkeeping, outputs.

A tiny preset on a CPU puts the host work in the foreground (its model step is short, like a GPU's); a full-size
preset on a CPU shows that the host work vanishes behind the model there.

Run: ``python benchmarks/host_loop.py [--presets mingru-tiny mamba-tiny] [--batch 256] [--profile]``
"""

from __future__ import annotations

import sys
from pathlib import Path

# Runs from a checkout without installing: rnnserve finds its folders beside rnnserve/.
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import argparse  # noqa: E402
import cProfile  # noqa: E402
import pstats  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402

import torch  # noqa: E402

from rnnserve.engine.config import EngineConfig  # noqa: E402
from rnnserve.engine.llm_engine import LLMEngine, freeze_startup_heap  # noqa: E402
from rnnserve.engine.loader import build_random  # noqa: E402
from rnnserve.engine.models.base import DecodeBatch  # noqa: E402
from rnnserve.engine.sampling_params import OutputKind, SamplingParams  # noqa: E402

PROMPT_LEN = 16
TARGET_RATIO = 1.15


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(call: Callable[[], object], steps: int, device: torch.device) -> float:
    """Milliseconds per call over ``steps`` calls (after one untimed call)."""
    call()
    synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        call()
    synchronize(device)
    return (time.perf_counter() - start) / steps * 1e3


def start_decoding(engine: LLMEngine, batch: int, kind: OutputKind, max_tokens: int) -> list[str]:
    """Add ``batch`` greedy requests and step until every one of them decodes; returns their ids."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, output_kind=kind)
    generator = torch.Generator().manual_seed(0)
    vocab = min(engine.model.vocab_size, 256)  # byte ids: every tokenizer of a random preset knows them
    ids = [
        engine.add_request(torch.randint(0, vocab, (PROMPT_LEN,), generator=generator).tolist(), params)
        for _ in range(batch)
    ]
    for _ in range(batch * PROMPT_LEN // engine.config.max_num_batched_tokens + 4):
        engine.step()
        if engine.last_step.decode_batch_size == batch and engine.last_step.prefill_tokens == 0:
            return ids
    raise RuntimeError(f"{batch} requests were not all decoding after their prefill")


def engine_step_ms(engine: LLMEngine, batch: int, kind: OutputKind, steps: int) -> float:
    """Milliseconds per engine step while all ``batch`` requests decode (the requests are aborted after)."""
    ids = start_decoding(engine, batch, kind, max_tokens=steps + 8)
    try:
        ms = timed(engine.step, steps, engine.device)
        if engine.last_step.decode_batch_size != batch:
            raise RuntimeError(f"a timed step decoded {engine.last_step.decode_batch_size}, not {batch}")
        return ms
    finally:
        for request_id in ids:
            engine.abort_request(request_id)


def model_step(engine: LLMEngine, batch: int) -> Callable[[], object]:
    """One decode of ``batch`` slots on a prebuilt input: the CUDA graph replay when the engine has graphs."""
    tokens = torch.randint(0, engine.model.vocab_size, (batch,)).tolist()
    inputs = DecodeBatch.build(tokens, range(batch), [PROMPT_LEN] * batch, engine.device)
    graphs = engine.runner.graphs

    @torch.inference_mode()
    def step() -> object:
        return graphs(inputs) if graphs is not None else engine.model.decode(inputs, engine.pool.tensors)

    return step


def bench_preset(preset: str, args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> list[list[str]]:
    model, tokenizer = build_random(preset, device, dtype)
    config = EngineConfig(
        max_num_seqs=args.batch, max_num_batched_tokens=max(2048, PROMPT_LEN * args.batch), enable_prefix_cache=False
    )
    engine = LLMEngine(model, tokenizer, config)
    freeze_startup_heap()  # as `rnnserve serve` and `LLM` do
    kinds = [OutputKind(k) for k in args.kinds]
    model_ms: list[float] = []
    engine_ms: dict[OutputKind, list[float]] = {k: [] for k in kinds}
    step = model_step(engine, args.batch)
    for _ in range(args.reps):
        model_ms.append(timed(step, args.steps, device))
        for kind in kinds:
            engine_ms[kind].append(engine_step_ms(engine, args.batch, kind, args.steps))
    model_median = statistics.median(model_ms)
    rows = []
    for kind in kinds:
        median = statistics.median(engine_ms[kind])
        rows.append([preset, kind.value, f"{model_median:.3f}", f"{median:.3f}", f"{median - model_median:.3f}",
                     f"{median / model_median:.2f}"])  # fmt: skip
    if args.profile:
        ids = start_decoding(engine, args.batch, kinds[0], max_tokens=args.steps + 8)
        profile = cProfile.Profile()
        profile.runcall(lambda: [engine.step() for _ in range(args.steps)])
        print(f"\n{preset}, {kinds[0].value}: where {args.steps} engine steps spend their time")
        pstats.Stats(profile).sort_stats("tottime").print_stats(25)
        for request_id in ids:
            engine.abort_request(request_id)
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=["mingru-tiny", "mamba-tiny"], help="random: presets")
    parser.add_argument("--batch", type=int, default=256, help="decode batch (default: 256)")
    parser.add_argument("--steps", type=int, default=50, help="timed steps per measurement (default: 50)")
    parser.add_argument("--reps", type=int, default=3, help="interleaved repetitions, median kept (default: 3)")
    parser.add_argument("--kinds", nargs="+", choices=[k.value for k in OutputKind],
                        default=[k.value for k in (OutputKind.FINAL_ONLY, OutputKind.DELTA, OutputKind.CUMULATIVE)])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32")
    parser.add_argument("--threads", type=int, default=None, help="torch threads on CPU (default: torch's)")
    parser.add_argument("--profile", action="store_true", help="also print where the first kind's steps go")
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("no CUDA device")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    where = torch.cuda.get_device_name() if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"host loop at batch {args.batch}: {where}, {args.dtype} weights, median of {args.reps} x {args.steps} steps")
    header = ["preset", "outputs", "model ms", "engine ms", "host ms", "engine / model"]
    rows = [row for preset in args.presets for row in bench_preset(preset, args, device, dtype)]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    print("  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)))
    for row in rows:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)))
    print(f"(target: engine / model <= {TARGET_RATIO})")


if __name__ == "__main__":
    main()
