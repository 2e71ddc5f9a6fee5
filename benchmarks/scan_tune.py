"""Launch choices for Mamba-1's varlen prefill scan (``kernels/selective_scan/chunk.py``) on this device.

One program scans ``block_d`` channels of one segment of at most ``segment_len`` tokens (0: whole sequences),
token by token; this times the (block_d, num_warps, segment_len) choices on mamba-370m's layer sizes
(``d_inner`` 2048, ``d_state`` 16, bf16 inputs, dt bias + softplus, D skip and z gate, bf16 output) for one
16,384-token prompt and for 8 x 2048, and prints tok/ms of one layer's scan per choice, best first, with the
wrapper's default marked. ``--smoke`` runs two choices on tiny sizes on CPU (Triton interpreter).

    python benchmarks/scan_tune.py
    TRITON_INTERPRET=1 python benchmarks/scan_tune.py --smoke
"""

from __future__ import annotations

import sys
from pathlib import Path

# Runs from a checkout without installing: rnnserve finds its folders beside rnnserve/.
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import itertools  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.decode import seconds_per_step  # noqa: E402
from benchmarks.tune import device_name, tuning_device  # noqa: E402
from rnnserve.kernels.selective_scan.chunk import selective_scan_varlen_triton  # noqa: E402


def scan_inputs(lengths: list[int], d_inner: int, d_state: int, dtype: torch.dtype, device: torch.device) -> dict:
    """Random inputs of one layer's scan over packed prompts of ``lengths`` tokens (states in a pool)."""
    total = sum(lengths)
    x, dt, z = (torch.randn(total, d_inner, device=device).to(dtype) for _ in range(3))
    B, C = (torch.randn(total, d_state, device=device).to(dtype) for _ in range(2))
    return {
        "x": x, "dt": dt, "z": z, "B": B, "C": C,
        "A": -torch.rand(d_inner, d_state, device=device) - 0.1,
        "D": torch.randn(d_inner, device=device),
        "dt_bias": torch.randn(d_inner, device=device) - 3,
        "cu_seqlens": F.pad(torch.tensor(lengths, device=device).cumsum(0), (1, 0)),
        "initial_state": torch.randn(len(lengths) + 3, d_inner, d_state, device=device),
        "slot_ids": torch.arange(len(lengths), device=device) + 3,
    }


def run(inputs: dict, **launch: int) -> None:
    selective_scan_varlen_triton(**inputs, dt_softplus=True, out_dtype=inputs["x"].dtype, **launch)


def main() -> None:
    smoke, device = tuning_device(__doc__.splitlines()[0])
    if smoke:
        d_inner, shapes, steps = 32, {"1x40": [40], "2x16": [16, 16]}, 1
        choices = [None, (8, 1, 16)]
    else:
        d_inner, shapes, steps = 2048, {"1x16384": [16384], "8x2048": [2048] * 8}, 5
        choices = [None, *itertools.product([32, 64, 128], [1, 2, 4], [256, 512, 1024]), (32, 1, 0)]
    print(f"{device_name(device)}: one scan layer, d_inner "
          f"{d_inner}, d_state 16, bf16 inputs; tok/ms per choice (block_d, num_warps, segment_len)",
          flush=True)
    dtype = torch.float32 if smoke else torch.bfloat16
    for shape, lengths in shapes.items():
        inputs = scan_inputs(lengths, d_inner, 16, dtype, device)
        results = []
        for choice in choices:
            names = ("block_d", "num_warps", "segment_len")
            launch = {} if choice is None else dict(zip(names, choice, strict=True))
            seconds = seconds_per_step(lambda i=inputs, launch=launch: run(i, **launch), device, steps)
            name = "default" if choice is None else "(" + ", ".join(map(str, choice)) + ")"
            results.append((sum(lengths) / (seconds * 1e3), name))
        for rate, name in sorted(results, reverse=True):
            print(f"{shape:8s} {name:16s} {rate:10.1f} tok/ms", flush=True)


if __name__ == "__main__":
    main()
