"""Launch choices for the varlen causal conv1d prefill (``kernels/causal_conv1d/chunk.py``) on this device.

Times every (block_t, block_c, num_warps) choice of one layer's conv as the Mamba models run it in prefill
(width 4, bias, SiLU fused, ``x`` a column slice of the in_proj output read in place): mamba-370m's 2048
channels and mamba2-370m's 2304 (x, B and C), bf16, for one 16,384-token prompt and for 8 x 2048, and prints
tok/ms per choice, best first, with the wrapper's default marked. ``--smoke`` runs two choices on tiny sizes
on CPU (Triton interpreter).

    python benchmarks/conv_tune.py
    TRITON_INTERPRET=1 python benchmarks/conv_tune.py --smoke
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
from rnnserve.kernels.causal_conv1d.chunk import causal_conv1d_varlen_triton  # noqa: E402


def conv_inputs(lengths: list[int], channels: int, dtype: torch.dtype, device: torch.device) -> dict:
    """One layer's conv inputs: ``x`` a column slice of a wider projection, per-sequence initial tails."""
    total = sum(lengths)
    projected = torch.randn(total, 2 * channels + 32, device=device).to(dtype)
    return {
        "x": projected[:, channels : 2 * channels],
        "weight": torch.randn(channels, 4, device=device).to(dtype),
        "bias": torch.randn(channels, device=device).to(dtype),
        "cu_seqlens": F.pad(torch.tensor(lengths, device=device).cumsum(0), (1, 0)),
        "initial_state": torch.randn(len(lengths), channels, 3, device=device),
        "silu": True,
    }


def main() -> None:
    smoke, device = tuning_device(__doc__.splitlines()[0])
    if smoke:
        widths, shapes, steps = {"c40": 40}, {"1x40": [40], "2x16": [16, 16]}, 1
        choices = [None, (16, 16, 1)]
    else:
        steps = 5
        widths = {"mamba": 2048, "mamba2": 2304}
        shapes = {"1x16384": [16384], "8x2048": [2048] * 8}
        choices = [None, *itertools.product([16, 32, 64], [64, 128, 256], [4, 8])]
    print(f"{device_name(device)}: one conv layer (width 4, SiLU), "
          "bf16; tok/ms per choice (block_t, block_c, num_warps)", flush=True)
    dtype = torch.float32 if smoke else torch.bfloat16
    for (model, channels), (shape, lengths) in itertools.product(widths.items(), shapes.items()):
        inputs = conv_inputs(lengths, channels, dtype, device)
        results = []
        for choice in choices:
            launch = {} if choice is None else dict(zip(("block_t", "block_c", "num_warps"), choice, strict=True))
            def run(inputs: dict = inputs, launch: dict = launch) -> None:
                causal_conv1d_varlen_triton(**inputs, **launch)

            seconds = seconds_per_step(run, device, steps)
            name = "default" if choice is None else "(" + ", ".join(map(str, choice)) + ")"
            results.append((sum(lengths) / (seconds * 1e3), name))
        for rate, name in sorted(results, reverse=True)[:8]:
            print(f"{model:7s} {shape:8s} {name:14s} {rate:10.1f} tok/ms", flush=True)


if __name__ == "__main__":
    main()
