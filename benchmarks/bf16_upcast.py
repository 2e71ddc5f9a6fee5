"""bf16 products past the GEMV kernel on a CPU without bf16 arithmetic: ATen's bf16 GEMM vs the fp32 GEMM of the
upcast operands (``rnnserve.kernels.gemv.UPCAST_BF16_GEMM``), in one process, interleaved round by round.

For a bf16 ``random:`` preset: prefill tok/s of a packed batch (``--prefills``, sequences x tokens) and decode
tok/s at batches past the GEMV kernel's 64 rows (``--batches``), with the switch set and cleared; the median of
``--rounds`` rounds of each and their ratio. On a CPU with AVX512-BF16 or AMX the engine leaves the switch off
(the table says which this CPU is); the comparison runs either way.

Run: ``python benchmarks/bf16_upcast.py [--preset mamba-130m] [--rounds 3]``
"""

from __future__ import annotations

import sys
from pathlib import Path

# Runs from a checkout without installing: rnnserve finds its folders beside rnnserve/.
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402

import torch  # noqa: E402

from rnnserve.engine.loader import build_random  # noqa: E402
from rnnserve.engine.models.base import DecodeBatch, PrefillBatch, RecurrentLM  # noqa: E402
from rnnserve.engine.state_pool import StatePool  # noqa: E402
from rnnserve.kernels import gemv  # noqa: E402
from rnnserve.kernels.cpu_extension import build_cpu_extension  # noqa: E402


def seconds(call: Callable[[], object], repeats: int) -> float:
    call()
    start = time.perf_counter()
    for _ in range(repeats):
        call()
    return (time.perf_counter() - start) / repeats


def workloads(model: RecurrentLM, pool: StatePool, args: argparse.Namespace) -> list[tuple[str, int, Callable]]:
    """``(name, tokens per call, call)`` for every prefill and decode case."""
    generator = torch.Generator().manual_seed(0)
    vocab = model.vocab_size
    cases = []
    for seqs, length in args.prefills:
        ids = [torch.randint(0, vocab, (length,), generator=generator).tolist() for _ in range(seqs)]
        batch = PrefillBatch.build(ids, list(range(seqs)), [0] * seqs, "cpu")
        cases.append((f"prefill {seqs}x{length}", seqs * length, lambda b=batch: model.prefill(b, pool.tensors)))
    for size in args.batches:
        ids = torch.randint(0, vocab, (size,), generator=generator).tolist()
        batch = DecodeBatch.build(ids, list(range(size)), [8] * size, "cpu")
        cases.append((f"decode batch {size}", size, lambda b=batch: model.decode(b, pool.tensors)))
    return cases


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="mamba-130m", help="random: preset (default: mamba-130m)")
    parser.add_argument("--prefills", nargs="+", default=["1x2048", "32x64"], help="sequences x tokens")
    parser.add_argument("--batches", nargs="+", type=int, default=[96, 256], help="decode batches (default: 96 256)")
    parser.add_argument("--repeats", type=int, default=2, help="calls per timing (default: 2)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds, median kept (default: 3)")
    args = parser.parse_args(argv)
    args.prefills = [tuple(int(n) for n in p.split("x")) for p in args.prefills]
    build_cpu_extension()
    model, _ = build_random(args.preset, torch.device("cpu"), torch.bfloat16)
    slots = max([s for s, _ in args.prefills] + args.batches)
    pool = StatePool.from_budget(model.state_spec(), max_num_seqs=slots, state_memory=None, device=torch.device("cpu"))
    native = gemv.native_bf16_gemm()
    print(f"{args.preset} bf16 on {torch.get_num_threads()} threads; this CPU has "
          f"{'bf16 arithmetic: the engine keeps ATen bf16' if native else 'no bf16 arithmetic: the engine upcasts'}")
    cases = workloads(model, pool, args)
    times: dict[tuple[str, bool], list[float]] = {}
    with torch.inference_mode():
        for round_index in range(args.rounds):
            for name, _, call in cases:
                for upcast in (round_index % 2 == 0, round_index % 2 == 1):
                    gemv.UPCAST_BF16_GEMM = upcast
                    times.setdefault((name, upcast), []).append(seconds(call, args.repeats))
    gemv.UPCAST_BF16_GEMM = not native
    print(f"{'case':<20} {'ATen bf16 tok/s':>16} {'fp32 upcast tok/s':>18} {'ratio':>7}")
    for name, tokens, _ in cases:
        aten, upcast = (tokens / statistics.median(times[(name, flag)]) for flag in (False, True))
        print(f"{name:<20} {aten:16.1f} {upcast:18.1f} {upcast / aten:6.2f}x")


if __name__ == "__main__":
    main()
