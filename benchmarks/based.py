"""Based-360M prefill and decode throughput against Mamba-370M measured in the same run (random weights).

CPU (default): prefill of one ``--prompt``-token sequence and decode steps at each ``--batches`` size, for
``random:based-360m`` and ``random:mamba-370m``; the last column is Based over Mamba. ``--device cuda`` runs the
paper's Table 1 setting (H100): prefill of 16,384 tokens and decode at batch 128 (CUDA graphs), in tokens/ms,
beside the paper's figures (Based-360M 514.57 prefill / 47.23 generated tokens/ms; Mamba 267.09 / 39.95).

    python benchmarks/based.py [--dtype fp32|bf16] [--prompt 512] [--batches 1 8] [--steps 8]
    python benchmarks/based.py --device cuda [--dtype bf16]
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

from rnnserve.engine.cuda_graph_runner import CUDAGraphDecodeRunner  # noqa: E402
from rnnserve.engine.loader import build_random  # noqa: E402
from rnnserve.engine.models.base import DecodeBatch, PrefillBatch  # noqa: E402
from rnnserve.engine.state_pool import StatePool  # noqa: E402
from rnnserve.kernels.cpu_extension import build_cpu_extension  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
MODELS = ("based-360m", "mamba-370m")
PAPER = {"based-360m": (514.57, 47.23), "mamba-370m": (267.09, 39.95)}  # Table 1: prefill, generate tokens/ms


def best_seconds(run: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Fastest of ``repeats`` timed calls after one warm-up call."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    run()
    sync()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        sync()
        best = min(best, time.perf_counter() - start)
    return best


def measure(preset: str, device: torch.device, dtype: torch.dtype, args: argparse.Namespace) -> dict[str, float]:
    """Tokens/s of one prefill and of decode at each batch size."""
    model, _ = build_random(preset, device, dtype)
    max_batch = max(args.batches)
    pool = StatePool(model.state_spec(), num_slots=max_batch, device=device)
    prompt = torch.randint(0, 50000, (args.prompt,)).tolist()
    prefill = PrefillBatch.build([prompt], [0], device=device)
    results = {"prefill": args.prompt / best_seconds(lambda: model.prefill(prefill, pool.tensors), device, 2)}
    decode: Callable[[DecodeBatch], torch.Tensor] = lambda batch: model.decode(batch, pool.tensors)  # noqa: E731
    if device.type == "cuda":
        runner = CUDAGraphDecodeRunner(model, pool.tensors, pool.scratch_slot, max_batch)
        runner.capture()
        decode = runner
    for batch in args.batches:
        tokens = torch.randint(0, 50000, (batch,)).tolist()
        step = DecodeBatch.build(tokens, range(batch), [args.prompt] * batch, device)

        def steps(step: DecodeBatch = step) -> None:
            for _ in range(args.steps):
                decode(step)

        results[f"decode@{batch}"] = batch * args.steps / best_seconds(steps, device, 2)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: fp32 on CPU, bf16 on CUDA")
    parser.add_argument("--prompt", type=int, default=None, help="prefill tokens (CPU 512, CUDA 16384)")
    parser.add_argument("--batches", nargs="+", type=int, default=None, help="decode batches (CPU 1 8, CUDA 128)")
    parser.add_argument("--steps", type=int, default=None, help="decode steps per timing (CPU 8, CUDA 64)")
    args = parser.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if cuda and not torch.cuda.is_available():
        parser.error("no CUDA device")
    dtype = DTYPES[args.dtype or ("bf16" if cuda else "fp32")]
    args.prompt = args.prompt or (16384 if cuda else 512)
    args.batches = args.batches or ([128] if cuda else [1, 8])
    args.steps = args.steps or (64 if cuda else 8)
    if not cuda:
        build_cpu_extension()
    results = {}
    for preset in MODELS:
        results[preset] = measure(preset, device, dtype, args)
        if cuda:
            torch.cuda.empty_cache()
    name = torch.cuda.get_device_name() if cuda else "CPU"
    print(f"{name}, {dtype}, prefill {args.prompt} tokens (batch 1), decode {args.steps} steps; random weights")
    print(f"{'metric':14} {'based-360m':>13} {'mamba-370m':>13} {'based/mamba':>12}")
    unit, scale = ("tok/ms", 1e-3) if cuda else ("tok/s", 1.0)
    for metric in results["based-360m"]:
        based, mamba = results["based-360m"][metric] * scale, results["mamba-370m"][metric] * scale
        print(f"{metric + ' ' + unit:14} {based:13.2f} {mamba:13.2f} {based / mamba:11.2f}x")
    if cuda:
        for preset, (prefill, generate) in PAPER.items():
            print(f"paper Table 1 (H100) {preset}: prefill {prefill} tok/ms, generate {generate} tok/ms")


if __name__ == "__main__":
    with torch.inference_mode():
        main()
