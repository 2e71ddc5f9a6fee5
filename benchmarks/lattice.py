"""Prefill and decode tokens/s of a Lattice model against Mamba-1 of about the same size, measured in one run.

Lattice's recurrence has no parallel form: prefill is a sequential fused scan (the C++ kernel on CPU, the Triton
kernel on CUDA), while Mamba's prefill uses its selective-scan kernels. Each row is a random preset on the same
device and dtype; ``vs baseline`` is the Lattice rate over the Mamba rate of the same workload.

    python benchmarks/lattice.py [--device cpu|cuda] [--dtype fp32|bf16] [--prompt-len 512] [--batches 1 8]
"""

from __future__ import annotations

import sys
from pathlib import Path

# Runs from a checkout without installing: rnnserve finds its folders beside rnnserve/.
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import argparse  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402

import torch  # noqa: E402

from rnnserve.engine.loader import build_random  # noqa: E402
from rnnserve.engine.models.base import DecodeBatch, PrefillBatch, RecurrentLM  # noqa: E402
from rnnserve.engine.state_pool import StatePool  # noqa: E402
from rnnserve.kernels.cpu_extension import build_cpu_extension  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def seconds_per_call(call: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median wall time of ``call`` after one warm-up call."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    call()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        sync()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def prefill_rate(model: RecurrentLM, device: torch.device, prompt_len: int, batch: int, repeats: int) -> float:
    """Prompt tokens/s for ``batch`` fresh prompts of ``prompt_len`` tokens in one packed prefill."""
    pool = StatePool(model.state_spec(), batch, device)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (prompt_len,), generator=gen) for _ in range(batch)]
    slots = list(range(batch))
    prefill = PrefillBatch.build(prompts, slots, device=device)

    def call() -> None:
        pool.reset(torch.tensor(slots))
        model.prefill(prefill, pool.tensors)

    return batch * prompt_len / seconds_per_call(call, device, repeats)


def decode_rate(model: RecurrentLM, device: torch.device, batch: int, repeats: int) -> float:
    """Generated tokens/s of one decode step for ``batch`` sequences."""
    pool = StatePool(model.state_spec(), batch, device)
    step = DecodeBatch.build([7] * batch, list(range(batch)), [100] * batch, device=device)
    return batch / seconds_per_call(lambda: model.decode(step, pool.tensors), device, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: fp32 on CPU, bf16 on CUDA")
    parser.add_argument("--models", nargs=2, default=["lattice-110m", "mamba-130m"], help="presets; baseline 2nd")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--prefill-batches", nargs="+", type=int, default=[1, 4])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8], help="decode batch sizes")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device")
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    if device.type == "cpu":
        build_cpu_extension()
    name = torch.cuda.get_device_name() if device.type == "cuda" else f"CPU ({torch.get_num_threads()} threads)"
    print(f"{name}, {dtype}, prompts of {args.prompt_len} tokens")
    rates: dict[tuple[str, str, int], float] = {}
    with torch.inference_mode():
        for preset in args.models:
            model, _ = build_random(preset, device, dtype)
            for batch in args.prefill_batches:
                rates[preset, "prefill", batch] = prefill_rate(model, device, args.prompt_len, batch, args.repeats)
            for batch in args.batches:
                rates[preset, "decode", batch] = decode_rate(model, device, batch, args.repeats)
            del model
    lattice, baseline = args.models
    print(f"{'phase':8} {'batch':>5} {lattice + ' tok/s':>20} {baseline + ' tok/s':>20} {'vs baseline':>12}")
    for phase, batches in (("prefill", args.prefill_batches), ("decode", args.batches)):
        for batch in batches:
            ours, theirs = rates[lattice, phase, batch], rates[baseline, phase, batch]
            print(f"{phase:8} {batch:>5} {ours:>20.1f} {theirs:>20.1f} {ours / theirs:>11.2f}x")


if __name__ == "__main__":
    main()
