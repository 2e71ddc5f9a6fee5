"""Engine throughput: continuous batching vs one request at a time, chunked prefill vs token-by-token.

For each concurrency C, C requests (prompt ``--prompt-len`` tokens, ``--new-tokens`` generated, EOS
ignored) run together through the engine; the baseline is the same kind of request run one at a time
through the same engine in the same process. Prefill: one ``--long-prompt`` token prompt through
chunked prefill vs feeding its first ``--token-by-token`` tokens through decode one at a time (a
recurrent model's per-token decode cost is constant, so the rate extrapolates).

Run: ``python benchmarks/engine_throughput.py [--model random:mingru-100m] [--threads 2]``
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

# Runs from a checkout without installing: rnnserve finds its folders beside rnnserve/.
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rnnserve.engine.config import EngineConfig
from rnnserve.engine.llm_engine import LLMEngine, freeze_startup_heap
from rnnserve.engine.loader import load_model
from rnnserve.engine.models.base import DecodeBatch, PrefillBatch
from rnnserve.engine.sampling_params import OutputKind, SamplingParams


def _prompt(seed: int, length: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, min(vocab, 256), (length,), generator=g).tolist()


@contextlib.contextmanager
def served_heap() -> Iterator[None]:
    """The garbage collector as ``LLM`` and the server set it up once the engine is built
    (:func:`freeze_startup_heap`: everything made so far frozen, a higher young threshold), for the block's
    measurements; unfrozen after it, so that the block's engine and model can be freed. Without it an engine
    driven directly pays full collections of the whole heap that a served one does not (on this VM about 110 ms
    every few runs of 256 x 256 tokens)."""
    threshold = gc.get_threshold()
    freeze_startup_heap()
    try:
        yield
    finally:
        gc.unfreeze()
        gc.set_threshold(*threshold)


def generated_tokens_per_second(
    engine: LLMEngine,
    concurrency: int,
    prompt_len: int,
    new_tokens: int,
    output_kind: OutputKind = OutputKind.FINAL_ONLY,
    collect: Callable[[LLMEngine], object] | None = None,
) -> float:
    """Generated tok/s of ``concurrency`` greedy requests stepped to their end; ``output_kind`` is what each
    request reads (``DELTA``: a stream's per-step outputs). With ``collect``, each step runs without collecting
    and ``collect(engine)`` collects its outputs instead (e.g. as the rows the engine process sends)."""
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True, output_kind=output_kind)
    for i in range(concurrency):
        engine.add_request(_prompt(i, prompt_len, engine.model.vocab_size), params)
    generated = 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        if collect is None:
            engine.step()
        else:
            engine.step(collect=False)
            collect(engine)
        generated += engine.last_step.generated_tokens
    return generated / (time.perf_counter() - start)


def prefill_rates(engine: LLMEngine, long_prompt: int, token_by_token: int) -> tuple[float, float]:
    ids = _prompt(0, long_prompt, engine.model.vocab_size)
    (slot,) = engine.pool.allocate()
    start = time.perf_counter()
    chunk = engine.config.max_num_batched_tokens
    model, state, device = engine.model, engine.pool.tensors, engine.device
    with torch.inference_mode():
        for begin in range(0, long_prompt, chunk):
            model.prefill(PrefillBatch.build([ids[begin : begin + chunk]], [slot], [begin], device), state)
        chunked = long_prompt / (time.perf_counter() - start)
        engine.pool.reset(torch.tensor([slot]))
        start = time.perf_counter()
        for position, token in enumerate(ids[:token_by_token]):
            model.decode(DecodeBatch.build([token], [slot], [position], device), state)
    stepwise = token_by_token / (time.perf_counter() - start)
    engine.pool.free([slot])
    return chunked, stepwise


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="random:mingru-100m")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--baseline-requests", type=int, default=2, help="one-at-a-time requests for the baseline")
    parser.add_argument("--long-prompt", type=int, default=4096)
    parser.add_argument("--token-by-token", type=int, default=256)
    parser.add_argument("--chunk", type=int, default=1024, help="prefill token budget per step")
    parser.add_argument("--json", default=None, help="write the figures to this file")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model, device=args.device, dtype=args.dtype)
    engine = LLMEngine(
        model, tokenizer, EngineConfig(max_num_seqs=max(args.concurrency), max_num_batched_tokens=args.chunk,
                                enable_prefix_cache=False)
    )
    freeze_startup_heap()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model {args.model}: {n_params / 1e6:.1f}M parameters, {args.dtype}, {engine.device}, "
          f"{torch.get_num_threads()} threads, state {engine.pool.bytes_per_slot} B/slot")
    generated_tokens_per_second(engine, 2, args.prompt_len, 4)  # warm-up
    single = [generated_tokens_per_second(engine, 1, args.prompt_len, args.new_tokens)
              for _ in range(args.baseline_requests)]
    baseline = sum(single) / len(single)
    rows = []
    print(f"\n{'concurrency':>11} {'tok/s':>9} {'vs one-at-a-time':>17}")
    print(f"{'1 (serial)':>11} {baseline:9.1f} {1.0:16.2f}x")
    for c in args.concurrency:
        rate = generated_tokens_per_second(engine, c, args.prompt_len, args.new_tokens)
        rows.append({"concurrency": c, "tokens_per_s": rate, "ratio": rate / baseline})
        print(f"{c:>11} {rate:9.1f} {rate / baseline:16.2f}x")
    chunked, stepwise = prefill_rates(engine, args.long_prompt, args.token_by_token)
    print(f"\nprefill of one {args.long_prompt}-token prompt: chunked {chunked:.0f} tok/s, "
          f"token-by-token {stepwise:.1f} tok/s, ratio {chunked / stepwise:.1f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "baseline_tokens_per_s": baseline, "concurrency": rows,
                       "prefill_chunked_tokens_per_s": chunked, "prefill_token_by_token_tokens_per_s": stepwise},
                      f, indent=2)


if __name__ == "__main__":
    main()
