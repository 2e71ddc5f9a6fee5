"""What checking weights for NaN and infinities costs a checkpoint load: the loader's check of the small weights
(``FINITE_CHECK_MAX_ELEMENTS``) and a check of every weight, each alternating with loads without a check in one
process.

    python benchmarks/load_finite_check.py [--preset mamba-130m] [--dtype float32] [--rounds 5]

Saves the random preset to a temporary directory, loads it from the page cache each round, and prints the median
load times and each check's ratio to the load without one.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from rnnserve.engine import loader


def timed_load(path: Path, limit: int) -> float:
    loader.FINITE_CHECK_MAX_ELEMENTS = limit
    start = time.perf_counter()
    loader.load_model(str(path), device="cpu")
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="mamba-130m")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(2)
    default = loader.FINITE_CHECK_MAX_ELEMENTS
    variants = {"no check": -1, f"small weights (<= {default} elements)": default, "every weight": 1 << 62}
    with tempfile.TemporaryDirectory() as tmp:
        model, _ = loader.load_model(f"random:{args.preset}", device="cpu", dtype=args.dtype)
        loader.save_checkpoint(model, tmp)
        size = sum(p.stat().st_size for p in Path(tmp).iterdir())
        del model
        timed_load(Path(tmp), -1)  # page cache and allocator warm
        times: dict[str, list[float]] = {name: [] for name in variants}
        for pair in (list(variants)[:2], ["no check", "every weight"]):  # a full check's garbage slowed the next load
            for round_ in range(args.rounds):  # ABBA: the second load of a pair frees the first's model
                for name in pair if round_ % 2 == 0 else reversed(pair):
                    times[name].append(timed_load(Path(tmp), variants[name]))
    base = statistics.median(times["no check"])
    print(f"random:{args.preset} {args.dtype}, {size / 2**20:.0f} MiB, median of {args.rounds} loads:")
    for name, values in times.items():
        print(f"  {name:40s} {statistics.median(values):.3f} s  {statistics.median(values) / base:.3f}x")
    print("the checks alone, on the loaded weights (best of 5; robust where loads are noisy):")
    weights = [t for t in loader.load_model(f"random:{args.preset}", device="cpu", dtype=args.dtype)[0]
               .state_dict().values() if t.is_floating_point()]  # fmt: skip
    for name, limit in list(variants.items())[1:]:
        checked = [t for t in weights if t.numel() <= limit]
        best = min(check_time(checked) for _ in range(5))
        print(f"  {name:40s} {best * 1e3:.1f} ms over {len(checked)} tensors, {best / base:.4f}x of a load")


def check_time(tensors: list[torch.Tensor]) -> float:
    start = time.perf_counter()
    for tensor in tensors:
        loader.non_finite_summary(tensor)
    return time.perf_counter() - start


if __name__ == "__main__":
    main()
