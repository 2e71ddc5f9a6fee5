"""Launch choices for the Triton Mamba-1 / Mamba-2 decode stacks (``kernels/mamba_decode/fused_recurrent.py``,
``kernels/mamba2_decode/fused_recurrent.py``) on this device, programmatic dependent launch among them.

Times a whole decode step of ``random:mamba-370m`` and ``random:mamba2-370m`` (bf16, a CUDA graph per batch size, 48
layers and the LM head) at batch 1, 2, 4 and 8: first the op-by-op step (``STACK_ENABLED`` cleared: cuBLAS GEMMs and
one kernel per other op), then the stack (at every batch it takes, whatever the models' ``STACK_MAX_BATCH``) at each
choice of (in_proj rows per program, out_proj rows per program, product tile, warps, programmatic dependent launch,
the small inputs' L2 prefetch under it, loads before the wait, later kernels' weights asked for by earlier ones),
each stack's own defaults among them, at batch 1 and 8, and at the model's default choice at 2 and 4 (where the
stack and the op-by-op step cross: ``STACK_MAX_BATCH``). Prints ms per step, the ratio to the op-by-op step measured
in the same run, the share of the HBM roofline (weight and state bytes over the device-to-device copy bandwidth
measured here) and the largest difference of the logits from the op-by-op step's, a line per choice as it is
measured (the model's default first, then the persistent launches), then the fastest three. ``--smoke`` runs the
two defaults on the tiny presets in fp32 on CPU (Triton interpreter, eager, no dependent launch).

    python benchmarks/decode_tune.py [--models mamba-370m] [--batches 1] [--steps 100]
    TRITON_INTERPRET=1 python benchmarks/decode_tune.py --smoke
"""

from __future__ import annotations

import sys
from pathlib import Path

# Runs from a checkout without installing: rnnserve finds its folders beside rnnserve/.
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import argparse  # noqa: E402
import contextlib  # noqa: E402
from collections.abc import Callable, Iterator  # noqa: E402

import torch  # noqa: E402

from benchmarks.decode import copy_bandwidth, seconds_per_step, weight_bytes  # noqa: E402
from benchmarks.tune import device_name, tuning_options  # noqa: E402
from rnnserve.engine.loader import build_random  # noqa: E402
from rnnserve.engine.models.base import DecodeBatch  # noqa: E402
from rnnserve.engine.state_pool import StatePool  # noqa: E402
from rnnserve.kernels import mamba2_decode as mamba2_decode_ops  # noqa: E402
from rnnserve.kernels import mamba_decode as mamba_decode_ops  # noqa: E402
from rnnserve.kernels.backend import force_triton  # noqa: E402
from rnnserve.kernels.mamba2_decode import fused_recurrent as mamba2_fused  # noqa: E402
from rnnserve.kernels.mamba_decode import fused_recurrent  # noqa: E402

KNOBS = ("IN_PROJ_ROWS", "OUT_PROJ_ROWS", "TILE", "OUT_PROJ_TILE", "NUM_WARPS",  # the GEMV kernels' shape
         "SSM_CHANNELS", "SSM_WARPS",  # the SSM kernel's
         "LAUNCH_PDL", "PREFETCH_INPUTS", "EARLY_LOADS", "PREFETCH_AHEAD",
         "PERSISTENT")  # one launch a step (a stack without it: off)  # fmt: skip
STACKS = (fused_recurrent, mamba2_fused)  # each holds its stack's KNOBS (PERSISTENT where it has one)


def knob_values(stack) -> tuple:
    """``stack``'s values of :data:`KNOBS` (a knob it does not have: False)."""
    return tuple(getattr(stack, name, False) for name in KNOBS)


DEFAULT = knob_values(fused_recurrent)
MAMBA2_DEFAULT = knob_values(mamba2_fused)


def varied(choice: tuple, **knobs: object) -> tuple:
    """``choice`` with the named :data:`KNOBS` changed."""
    values = dict(zip(KNOBS, choice, strict=True))
    unknown = set(knobs) - set(values)
    if unknown:
        raise ValueError(f"not launch knobs: {sorted(unknown)}")
    return tuple({**values, **knobs}[name] for name in KNOBS)


def around(default: tuple) -> list[tuple]:
    """A stack's default, and it with its SSM kernel's channels or warps changed, or one of its launch switches
    flipped."""
    values = dict(zip(KNOBS, default, strict=True))
    channels = values["SSM_CHANNELS"]
    return [default, *(varied(default, SSM_CHANNELS=c) for c in (channels // 4, channels // 2, channels * 2)),
            *(varied(default, SSM_WARPS=w) for w in (2, 8) if w != values["SSM_WARPS"]),
            varied(default, LAUNCH_PDL=not values["LAUNCH_PDL"]),
            varied(default, PREFETCH_INPUTS=not values["PREFETCH_INPUTS"]),
            varied(default, EARLY_LOADS=not values["EARLY_LOADS"]),
            varied(default, PREFETCH_AHEAD=not values["PREFETCH_AHEAD"])]


# GEMV shapes around the Mamba-1 stack's default, one knob at a time, then the pairs that trade program count
# against step length (also without dependent launch); then around each stack's default (see around).
_GEMV = [*({"IN_PROJ_ROWS": rows} for rows in (8, 16, 64)), *({"OUT_PROJ_ROWS": rows} for rows in (2, 4, 16)),
         *({"TILE": tile, "OUT_PROJ_TILE": tile} for tile in (4096, 8192)), {"NUM_WARPS": 4},
         *({"OUT_PROJ_TILE": tile} for tile in (4096, 8192))]
_PAIRS = [{"IN_PROJ_ROWS": rows, "OUT_PROJ_ROWS": out_rows, "TILE": tile, "OUT_PROJ_TILE": tile, "NUM_WARPS": warps}
          for rows, out_rows, tile, warps in ((8, 2, 16384, 8), (32, 8, 8192, 4), (8, 2, 4096, 4))]
# The Mamba-1 stack's persistent launch at its default shapes (compiled once, ~5 s more).
PERSISTENT_CHOICES = [varied(DEFAULT, PERSISTENT=True)]
# The Mamba-2 stack's persistent launch at its default shapes.
PERSISTENT_CHOICES.append(varied(MAMBA2_DEFAULT, PERSISTENT=True))
CHOICES = sorted({*(varied(DEFAULT, **knobs) for knobs in (*_GEMV, *_PAIRS)), *PERSISTENT_CHOICES,
                  *(varied(DEFAULT, **knobs, LAUNCH_PDL=not DEFAULT[KNOBS.index("LAUNCH_PDL")]) for knobs in _PAIRS),
                  *around(DEFAULT), *around(MAMBA2_DEFAULT)})


def measuring_order(choices: list[tuple], default: tuple) -> list[tuple]:
    """The model's default, the persistent launches, then the other choices: each line is printed as it is
    measured, so a sweep cut short by its time limit (or a launch that never returns) still reports these."""
    first = [c for c in dict.fromkeys((default, *PERSISTENT_CHOICES)) if c in choices]
    return [*first, *(c for c in choices if c not in first)]


SWEPT_BATCHES = (1, 8)  # every choice at these batch sizes; the default only at the others


@contextlib.contextmanager
def launch_choice(choice: tuple[int, ...] | None) -> Iterator[None]:
    """Both stacks with ``choice`` for :data:`KNOBS` (None: the op-by-op step) within the block."""
    saved = [knob_values(stack) for stack in STACKS]
    enabled = mamba_decode_ops.STACK_ENABLED
    max_batches = mamba_decode_ops.STACK_MAX_BATCH, mamba2_decode_ops.STACK_MAX_BATCH
    mamba_decode_ops.STACK_ENABLED = mamba2_decode_ops.STACK_ENABLED = choice is not None
    # Every batch the stacks take, also those the models leave to the op-by-op step (which this script times).
    mamba_decode_ops.STACK_MAX_BATCH = mamba2_decode_ops.STACK_MAX_BATCH = fused_recurrent.MAX_ROWS
    for stack, values in zip(STACKS, saved, strict=True):
        set_knobs(stack, choice or values)
    try:
        yield
    finally:
        mamba_decode_ops.STACK_ENABLED = mamba2_decode_ops.STACK_ENABLED = enabled
        mamba_decode_ops.STACK_MAX_BATCH, mamba2_decode_ops.STACK_MAX_BATCH = max_batches
        for stack, values in zip(STACKS, saved, strict=True):
            set_knobs(stack, values)


def set_knobs(stack, values: tuple) -> None:
    """Set ``stack``'s :data:`KNOBS` to ``values`` (those it has)."""
    for name, value in zip(KNOBS, values, strict=True):
        if hasattr(stack, name):
            setattr(stack, name, value)


def step_function(model, pool: StatePool, batch: DecodeBatch, graphed: bool) -> Callable[[], torch.Tensor]:
    """One decode step on ``pool`` (states reset to the same values before timing): a CUDA-graph replay, or the
    eager call."""
    if not graphed:
        return lambda: model.decode(batch, pool.tensors)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        model.decode(batch, pool.tensors)  # compiles this choice's kernels outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        logits = model.decode(batch, pool.tensors)

    def replay() -> torch.Tensor:
        graph.replay()
        return logits

    return replay


def tune_model(preset: str, dtype: torch.dtype, device: torch.device, batches: list[int], choices: list,
               steps: int, peak: float) -> None:
    """Time the op-by-op step and each choice of one model at each batch size; print one line per choice."""
    smoke = device.type != "cuda"
    model, _ = build_random(preset, device, dtype)
    weights = weight_bytes(model)
    default = MAMBA2_DEFAULT if preset.startswith("mamba2") else DEFAULT
    for batch_size in batches:
        pool = StatePool(model.state_spec(), num_slots=batch_size + 1, device=device)
        start = {name: torch.randn_like(t) * 0.1 for name, t in pool.tensors.items()}
        ids = torch.randint(0, model.vocab_size, (batch_size,)).tolist()
        batch = DecodeBatch.build(ids, list(range(batch_size, 0, -1)), [16] * batch_size, device=device)
        roofline = (weights + 2 * batch_size * pool.bytes_per_slot) / peak
        results, baseline_ms, baseline_logits = [], 0.0, None
        for choice in [None, *(measuring_order(choices, default) if batch_size in SWEPT_BATCHES else [default])]:
            with launch_choice(choice):
                for name, t in pool.tensors.items():
                    t.copy_(start[name])
                step = step_function(model, pool, batch, graphed=not smoke)
                for name, t in pool.tensors.items():
                    t.copy_(start[name])
                logits = step().clone()
                ms = seconds_per_step(step, device, steps) * 1e3
            if choice is None:
                baseline_ms, baseline_logits = ms, logits
                name = "op by op"
            else:
                name = ("default " if choice == default else "") + "(" + ",".join(map(str, choice)) + ")"
            diff = (logits - baseline_logits).abs().max().item()
            results.append((ms, name))
            print(f"{preset:12s} b={batch_size:<3d} {name:48s} {ms:8.3f} ms {baseline_ms / ms:6.2f}x "
                  f"{roofline * 1e3 / ms:6.1%} {diff:9.2e}", flush=True)
        print(f"# {preset} b={batch_size}, fastest: " + "; ".join(f"{name} {ms:.3f} ms" for ms, name in
                                                                  sorted(results)[:3]), flush=True)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", help="random: presets (default: mamba-370m mamba2-370m; smoke: the "
                        "tiny ones)")
    parser.add_argument("--batches", nargs="+", type=int, help="batch sizes (default: 1 2 4 8; smoke: 1)")
    parser.add_argument("--steps", type=int, help="timed steps per choice (default: 50; smoke: 1)")
    options, device = tuning_options(parser)
    smoke = options.smoke
    presets, dtype, batches, steps = (["mamba-tiny", "mamba2-tiny"], torch.float32, [1], 1) if smoke else (
        ["mamba-370m", "mamba2-370m"], torch.bfloat16, [1, 2, 4, 8], 50)
    presets, batches, steps = options.models or presets, options.batches or batches, options.steps or steps
    choices = [DEFAULT, MAMBA2_DEFAULT] if smoke else CHOICES
    peak = copy_bandwidth(device, 1 << 24 if smoke else 1 << 30)
    print(f"{device_name(device)}: decode step, {str(dtype).removeprefix('torch.')}; per choice "
          f"({', '.join(KNOBS)}): ms/step, vs op by op, HBM roofline at {peak / 1e9:.0f} GB/s, max |logits diff|",
          flush=True)
    with torch.inference_mode(), force_triton(True) if smoke else contextlib.nullcontext():
        for preset in presets:
            tune_model(preset, dtype, device, batches, choices, steps, peak)


if __name__ == "__main__":
    main()
