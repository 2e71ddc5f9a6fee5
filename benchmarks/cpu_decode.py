"""CPU decode throughput, new vs previous paths, against the memory-bandwidth roofline, in one run.

For each model, dtype and batch size: tokens/s of a decode step (``model.decode`` plus the greedy argmax)
with this work's CPU decode paths (the GEMV kernel :mod:`rnnserve.kernels.gemv` and Mamba's one-op layer stack
:func:`rnnserve.kernels.mamba_decode.mamba_decode_stack`) and without them (clearing ``gemv.ENABLED`` and
``mamba_decode.STACK_ENABLED`` runs the previous paths in the same process), the two interleaved round by round
(alternating which goes first) and the median of each kept; the bytes a step must read (every distinct weight
once, each sequence's state read and written); the read bandwidth measured in the same run, after each row's
timings (``torch.sum`` over 1 GiB: on a shared machine it drifts with the load); and the roofline fraction,
i.e. new tokens/s over ``batch * bandwidth / bytes per step``. The models use random weights (``random:``
presets).

    python benchmarks/cpu_decode.py [--models mamba-130m mamba2-130m mingru-100m hawk-100m]
        [--dtypes fp32 bf16] [--batches 1 8 32] [--steps 16] [--rounds 5]
"""

from __future__ import annotations

import sys
from pathlib import Path

# Runs from a checkout without installing: rnnserve finds its folders beside rnnserve/.
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import argparse  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402

import torch  # noqa: E402

from benchmarks.cpu_peers import read_bandwidth  # noqa: E402
from rnnserve.engine.loader import build_random  # noqa: E402
from rnnserve.engine.models.base import DecodeBatch, RecurrentLM  # noqa: E402
from rnnserve.engine.state_pool import StatePool  # noqa: E402
from rnnserve.kernels import gemv as gemv_module  # noqa: E402
from rnnserve.kernels import mamba_decode as mamba_decode_module  # noqa: E402
from rnnserve.kernels.cpu_extension import build_cpu_extension  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def weight_bytes(model: RecurrentLM) -> int:
    """Bytes of distinct parameters and buffers (a tied LM head counts once)."""
    tensors = [*model.parameters(), *model.buffers()]
    return sum({t.data_ptr(): t.numel() * t.element_size() for t in tensors}.values())


def switch_new_paths(enabled: bool) -> None:
    """Turn this work's CPU decode paths on (new) or off (the previous implementation)."""
    gemv_module.ENABLED = mamba_decode_module.STACK_ENABLED = enabled


def step_seconds(step: Callable[[], object], steps: int, enabled: bool) -> float:
    """Seconds per step over ``steps`` steps with the new paths switched on or off."""
    switch_new_paths(enabled)
    step()
    return timed(lambda: [step() for _ in range(steps)]) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["mamba-130m", "mamba2-130m", "mingru-100m", "hawk-100m"])
    parser.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["fp32", "bf16"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32])
    parser.add_argument("--steps", type=int, default=16, help="decode steps per timed round")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved new/old rounds (median kept)")
    args = parser.parse_args()
    if not build_cpu_extension():
        parser.error("the fused CPU kernels could not be built: nothing to compare")
    cpu = torch.device("cpu")
    print(f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    header = (
        f"{'model':13} {'dtype':5} {'batch':>5} {'old tok/s':>10} {'new tok/s':>10} {'new/old':>8} "
        f"{'MB/step':>8} {'GB/s':>6} {'roofline':>9} {'fraction':>9}"
    )
    print(header)
    for preset in args.models:
        for dtype_name in args.dtypes:
            model, _ = build_random(preset, cpu, DTYPES[dtype_name])
            weights = weight_bytes(model)
            pool = StatePool(model.state_spec(), num_slots=max(args.batches), device=cpu)
            for batch in args.batches:
                ids = torch.randint(0, model.vocab_size, (batch,), generator=torch.Generator().manual_seed(0))
                decode = DecodeBatch.build(ids.tolist(), range(batch), [0] * batch, device=cpu)

                def step(m: RecurrentLM = model, d: DecodeBatch = decode, p: StatePool = pool) -> torch.Tensor:
                    return m.decode(d, p.tensors).argmax(dim=-1)

                times: dict[bool, list[float]] = {True: [], False: []}
                for round_index in range(args.rounds):  # alternate which path goes first
                    for enabled in (True, False) if round_index % 2 == 0 else (False, True):
                        times[enabled].append(step_seconds(step, args.steps, enabled))
                new, old = times[True], times[False]
                switch_new_paths(True)
                new_s, old_s = statistics.median(new), statistics.median(old)
                bandwidth = read_bandwidth()
                step_bytes = weights + 2 * batch * pool.bytes_per_slot
                roofline = batch * bandwidth / step_bytes
                print(
                    f"{preset:13} {dtype_name:5} {batch:5d} {batch / old_s:10.1f} {batch / new_s:10.1f} "
                    f"{old_s / new_s:7.2f}x {step_bytes / 1e6:8.0f} {bandwidth / 1e9:6.1f} {roofline:9.1f} "
                    f"{batch / new_s / roofline:9.1%}",
                    flush=True,
                )
            del model, pool


if __name__ == "__main__":
    with torch.inference_mode():
        main()
