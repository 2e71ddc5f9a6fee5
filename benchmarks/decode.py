"""End-to-end decode throughput of minGRU LMs: eager vs CUDA graphs, and the memory-bandwidth roofline.

For each model and batch size: decode tokens/s, and the fraction of the roofline, i.e. the bytes a step
must move (every weight once, each sequence's state read and written) over the step time, relative to the
device-to-device copy bandwidth measured in the same run. ``--cpu-smoke`` runs a tiny model eagerly on CPU.

    python benchmarks/decode.py [--cpu-smoke] [--models mingru-100m mingru-1b] [--batches 1 8 64 256]
"""

from __future__ import annotations

import sys
from pathlib import Path

# Runs from a checkout without installing: rnnserve finds its folders beside rnnserve/.
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import argparse  # noqa: E402
import logging  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402

import torch  # noqa: E402

from rnnserve.engine.cuda_graph_runner import CUDAGraphDecodeRunner  # noqa: E402
from rnnserve.engine.loader import build_random  # noqa: E402
from rnnserve.engine.models.base import DecodeBatch, RecurrentLM  # noqa: E402
from rnnserve.engine.state_pool import StatePool  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def seconds_per_step(step: Callable[[], object], device: torch.device, steps: int) -> float:
    for _ in range(3):
        step()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    return (time.perf_counter() - start) / steps


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes/s of a device-to-device copy (read + write)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    return 2 * nbytes / seconds_per_step(lambda: dst.copy_(src), device, 20)


def weight_bytes(model: RecurrentLM) -> int:
    """Bytes of distinct parameters (a tied LM head counts once)."""
    seen = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    return sum(seen.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny model, eager, on CPU")
    parser.add_argument("--models", nargs="+", default=["mingru-100m", "mingru-1b"], help="random: presets")
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8, 64, 256])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.cpu_smoke:
        device, dtype, models, batches, steps = torch.device("cpu"), torch.float32, ["mingru-tiny"], [1, 8], 5
    elif not torch.cuda.is_available():
        parser.error("no CUDA device: use --cpu-smoke")
    else:
        device, dtype, models, batches, steps = (
            torch.device("cuda"), DTYPES[args.dtype], args.models, args.batches, args.steps
        )
    peak = copy_bandwidth(device, (16 if args.cpu_smoke else 1024) * 2**20)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print(f"{name}: copy bandwidth {peak / 1e9:.0f} GB/s; dtype {dtype}")
    print(f"{'model':14} {'batch':>5} {'mode':7} {'ms/step':>9} {'tokens/s':>10} {'roofline':>9} {'vs eager':>9}")
    for preset in models:
        model, _ = build_random(preset, device, dtype)
        max_batch = max(batches)
        pool = StatePool(model.state_spec(), num_slots=max_batch, device=device)
        modes: dict[str, Callable[[DecodeBatch], torch.Tensor]] = {
            "eager": lambda batch, m=model, p=pool: m.decode(batch, p.tensors)
        }
        if device.type == "cuda":
            runner = CUDAGraphDecodeRunner(model, pool.tensors, pool.scratch_slot, max_batch)
            runner.capture()
            modes["graphs"] = runner
        weights = weight_bytes(model)
        for batch in batches:
            ids = torch.randint(0, model.vocab_size, (batch,)).tolist()
            step = DecodeBatch.build(ids, range(batch), [0] * batch, device=device)
            step_bytes = weights + 2 * batch * pool.bytes_per_slot
            eager_seconds = None
            for mode, decode in modes.items():
                seconds = seconds_per_step(lambda d=decode, b=step: d(b), device, steps)
                eager_seconds = eager_seconds or seconds
                print(f"{preset:14} {batch:5d} {mode:7} {seconds * 1e3:9.3f} {batch / seconds:10.0f} "
                      f"{step_bytes / seconds / peak:9.1%} {eager_seconds / seconds:8.2f}x")
        del model, pool, modes
        if device.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    with torch.inference_mode():
        main()
