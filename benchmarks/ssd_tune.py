"""Launch choices for Mamba-2's chunked varlen SSD prefill (``kernels/ssd/chunk.py``) on this device.

Times one mamba2-370m layer's ``ssd_scan_varlen_triton`` (32 heads x 64 channels, 1 group, d_state 128, bf16
x/B/C, fp32 dt, states in a pool addressed by slot ids) for one 16,384-token prompt and for 8 x 2048, for the
wrapper's default and a sweep of launch choices (chunk size, tiles, warps, stages, ``C . B^T`` once per group
or per head). Prints tok/ms of one layer per choice, best first, with the default marked and each choice's
largest output difference from the default, then the default's time per kernel. ``--smoke`` runs two choices
on tiny sizes on CPU (Triton interpreter).

    python benchmarks/ssd_tune.py
    TRITON_INTERPRET=1 python benchmarks/ssd_tune.py --smoke
"""

from __future__ import annotations

import sys
from pathlib import Path

# Runs from a checkout without installing: rnnserve finds its folders beside rnnserve/.
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import functools  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.decode import seconds_per_step  # noqa: E402
from benchmarks.tune import device_name, tuning_device  # noqa: E402
from rnnserve.kernels.ssd import chunk as ssd_chunk  # noqa: E402

# Each choice changes the wrapper's defaults in these keyword arguments only.
SWEEP: list[dict[str, int | bool]] = [
    {"chunk_size": 128},
    {"precompute_cb": False},
    {"chunk_size": 128, "precompute_cb": False},
    {"chunk_size": 128, "block_k": 64},
    {"block_k": 64},
    {"block_m": 32},
    {"block_m": 128},
    {"block_n": 64},
    {"block_p": 32},
    {"state_block_n": 32},
    {"state_block_n": 128},
    {"num_warps": 8},
    {"block_k": 64, "block_n": 64},
    {"num_stages": 1},
    {"num_stages": 3},
]
SMOKE_SWEEP: list[dict[str, int | bool]] = [
    {"chunk_size": 32, "block_m": 16, "block_k": 16, "precompute_cb": False},
]


def ssd_inputs(lengths: list[int], heads: int, head_dim: int, d_state: int, dtype: torch.dtype,
               device: torch.device) -> dict:
    """Random inputs of one layer's SSD over packed prompts of ``lengths`` tokens (states in a pool)."""
    total = sum(lengths)
    return {
        "x": torch.randn(total, heads, head_dim, device=device).to(dtype),
        "dt": torch.rand(total, heads, device=device) * 0.099 + 0.001,
        "A": -torch.exp(torch.rand(heads, device=device) * math.log(16)),
        "B": torch.randn(total, 1, d_state, device=device).to(dtype),
        "C": torch.randn(total, 1, d_state, device=device).to(dtype),
        "D": torch.randn(heads, device=device),
        "cu_seqlens": F.pad(torch.tensor(lengths, device=device).cumsum(0), (1, 0)),
        "initial_state": torch.randn(len(lengths) + 3, heads, head_dim, d_state, device=device) * 0.1,
        "slot_ids": torch.arange(len(lengths), device=device) + 3,
    }


def run(inputs: dict, **launch: int | bool) -> torch.Tensor:
    return ssd_chunk.ssd_scan_varlen_triton(**inputs, **launch)[0]


class _TimedKernel:
    """Stands in for a Triton kernel in ``ssd_chunk`` and records the device time of each launch."""

    def __init__(self, kernel: object, name: str, log: list, clock: Callable[[], object]) -> None:
        self.kernel, self.name, self.log, self.clock = kernel, name, log, clock

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., None]:
        launch = self.kernel[grid]

        def timed(*args: object, **kwargs: object) -> None:
            start = self.clock()
            launch(*args, **kwargs)
            self.log.append((self.name, start, self.clock()))

        return timed


def kernel_seconds(step: Callable[[], object], device: torch.device, steps: int) -> dict[str, float]:
    """Seconds per step spent in each of the module's kernels (CUDA events around each launch)."""
    if device.type == "cuda":
        def clock() -> torch.cuda.Event:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event

        def elapsed(start: torch.cuda.Event, end: torch.cuda.Event) -> float:
            return start.elapsed_time(end) / 1e3
    else:
        clock = time.perf_counter

        def elapsed(start: float, end: float) -> float:
            return end - start
    names = [n for n in vars(ssd_chunk) if n.startswith("_ssd_") and n.endswith("_kernel")]
    originals = {n: getattr(ssd_chunk, n) for n in names}
    log: list = []
    try:
        for n in names:
            setattr(ssd_chunk, n, _TimedKernel(originals[n], n, log, clock))
        step()  # already compiled; one untimed pass
        if device.type == "cuda":
            torch.cuda.synchronize()
        log.clear()
        for _ in range(steps):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize()
    finally:
        for n in names:
            setattr(ssd_chunk, n, originals[n])
    seconds = dict.fromkeys(names, 0.0)
    for name, start, end in log:
        seconds[name] += elapsed(start, end) / steps
    return seconds


def _name(choice: dict[str, int | bool]) -> str:
    return ",".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in choice.items()) or "default"


def main() -> None:
    smoke, device = tuning_device(__doc__.splitlines()[0])
    if smoke:
        # fp32: the interpreter computes bf16 tl.dot wrongly.
        dtype, steps, sweep = torch.float32, 1, SMOKE_SWEEP
        heads, head_dim, d_state, shapes = 2, 16, 16, {"1x40": [40], "2x16": [16, 16]}
    else:
        dtype, steps, sweep = torch.bfloat16, 10, SWEEP
        heads, head_dim, d_state, shapes = 32, 64, 128, {"1x16384": [16384], "8x2048": [2048] * 8}
    print(f"{device_name(device)}: one SSD layer, {heads} heads x "
          f"{head_dim}, d_state {d_state}, 1 group, {str(dtype).removeprefix('torch.')} inputs; tok/ms per "
          f"choice (changes to the defaults) and its largest |y - y_default|", flush=True)
    for shape, lengths in shapes.items():
        torch.manual_seed(0)
        tune_shape(shape, ssd_inputs(lengths, heads, head_dim, d_state, dtype, device), sweep, device, steps,
                   strict=smoke)


def tune_shape(shape: str, inputs: dict, sweep: list[dict[str, int | bool]], device: torch.device, steps: int,
               strict: bool) -> None:
    """Print tok/ms per choice (best first) and the default's time per kernel on one packed batch."""
    tokens = inputs["x"].shape[0]
    pool = inputs["initial_state"].clone()  # each run overwrites the sequences' slots with their final states

    def output(choice: dict[str, int | bool]) -> torch.Tensor:
        inputs["initial_state"].copy_(pool)
        return run(inputs, **choice)

    y_default = output({}).clone()
    results = []
    for choice in [{}, *sweep]:
        try:
            diff = (output(choice) - y_default).abs().max().item()
            seconds = seconds_per_step(functools.partial(run, inputs, **choice), device, steps)
        except Exception as error:  # a choice the device cannot run (e.g. out of shared memory)
            if strict:
                raise
            print(f"{shape:8s} {_name(choice):40s} failed: {type(error).__name__}: {error}", flush=True)
            continue
        results.append((tokens / (seconds * 1e3), _name(choice), diff))
    for rate, name, diff in sorted(results, reverse=True):
        print(f"{shape:8s} {name:40s} {rate:10.1f} tok/ms  max|dy| {diff:.1e}", flush=True)
    default = functools.partial(run, inputs)
    total = seconds_per_step(default, device, steps)
    for name, seconds in kernel_seconds(default, device, steps).items():
        print(f"{shape:8s} kernel {name:33s} {seconds * 1e6:10.1f} us", flush=True)
    print(f"{shape:8s} kernel {'(all, with host work)':33s} {total * 1e6:10.1f} us", flush=True)

if __name__ == "__main__":
    main()
