"""Each kernel vs its PyTorch reference and ``torch.compile`` of the reference: time and memory bandwidth.

Bandwidth is the minimal traffic of the op (inputs read once, outputs and states written once) over the
time, as a fraction of the device's peak measured in the same run with a device-to-device copy. On CUDA the
public function runs Triton; ``--cpu-smoke`` runs small sizes on CPU (reference only) to keep this script
working without a GPU.

    python benchmarks/kernels.py [--cpu-smoke] [--dtype bf16] [--no-compile]
"""

from __future__ import annotations

import sys
from pathlib import Path

# This script shares its name with the ``kernels`` package: make ``import kernels`` find the package.
# Runs from a checkout without installing: rnnserve finds its folders beside rnnserve/.
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import argparse  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from rnnserve.kernels.add_norm import add_norm  # noqa: E402
from rnnserve.kernels.backend import force_triton  # noqa: E402
from rnnserve.kernels.causal_conv1d import causal_conv1d_update, causal_conv1d_varlen  # noqa: E402
from rnnserve.kernels.cpu_extension import build_cpu_extension  # noqa: E402
from rnnserve.kernels.diag_linear_scan import diag_linear_scan, diag_log_scan, diag_scan_step  # noqa: E402
from rnnserve.kernels.min_rnn_step import min_rnn_step  # noqa: E402

GRAPH_CALLS = 20
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def timed(fn: Callable[[], object], device: torch.device, min_seconds: float) -> float:
    """Seconds per call: warm up, then repeat until ``min_seconds`` have passed."""
    for _ in range(3):
        fn()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    calls, start = 0, time.perf_counter()
    while True:
        fn()
        calls += 1
        if calls % 5 == 0:
            sync()
            elapsed = time.perf_counter() - start
            if elapsed >= min_seconds:
                return elapsed / calls


def timed_on_device(
    fn: Callable[[], object], device: torch.device, min_seconds: float, capturable: bool
) -> tuple[float, bool]:
    """Seconds per call and whether they exclude launch overhead.

    On CUDA a ``capturable`` function is timed as CUDA-graph replays of ``GRAPH_CALLS`` calls, so Python
    launch overhead does not hide small decode kernels; others (references that synchronise on
    ``.tolist()``) and failed captures fall back to :func:`timed`.
    """
    if device.type != "cuda" or not capturable:
        return timed(fn, device, min_seconds), False
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for _ in range(GRAPH_CALLS):
                fn()
    except Exception:  # noqa: BLE001 - not capturable: time it eagerly instead
        torch.cuda.synchronize()
        return timed(fn, device, min_seconds), False
    return timed(graph.replay, device, min_seconds) / GRAPH_CALLS, True


def peak_bandwidth(device: torch.device, nbytes: int, min_seconds: float) -> float:
    """Bytes/s of a device-to-device copy (read + write)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    return 2 * nbytes / timed(lambda: dst.copy_(src), device, min_seconds)


@dataclass
class Case:
    name: str
    run: Callable[[], object]
    nbytes: int
    compile_reference: bool = True
    reference_capturable: bool = True


def cases(device: torch.device, dtype: torch.dtype, small: bool) -> list[Case]:
    """The ops at decode/prefill sizes of a ~1B minGRU (d_model 2048, hidden 4096), or tiny ones."""
    d_model, d_hidden, batch = (64, 128, 8) if small else (2048, 4096, 256)
    lengths = [5, 17, 64, 3] if small else [1024] * 8
    num_slots, width = batch + 1, 4
    size = torch.empty((), dtype=dtype).element_size()
    total = sum(lengths)

    def rand(*shape: int, dt: torch.dtype = dtype) -> torch.Tensor:
        return torch.randn(*shape, device=device).to(dt)

    cu = F.pad(torch.tensor(lengths).cumsum(0), (1, 0)).to(device)
    slots = torch.randperm(num_slots, device=device)[:batch]
    la, lb = -F.softplus(rand(total, d_hidden)), rand(total, d_hidden)
    a, h0 = torch.sigmoid(rand(total, d_hidden)), torch.rand(len(lengths), d_hidden, device=device)
    x_seq, w, bias = rand(total, d_model), rand(d_model, width), rand(d_model)
    conv0 = torch.randn(len(lengths), d_model, width - 1, device=device)
    h_pool = torch.rand(num_slots, d_hidden, device=device)
    conv_pool = torch.randn(num_slots, d_model, width - 1, device=device)
    step_a, step_b = torch.sigmoid(rand(batch, d_hidden)), rand(batch, d_hidden)
    proj = rand(batch, 2 * d_hidden)
    x_tok, rows = rand(batch, d_model), rand(total, d_model)
    ln_w, ln_b = rand(d_model), rand(d_model)
    state_rw = 2 * batch * d_hidden * 4
    return [
        Case(
            "diag_log_scan (prefill)",
            lambda: diag_log_scan(la, lb, cu, h0),
            total * d_hidden * (2 * size + 4),
            reference_capturable=False,
        ),
        Case(
            "diag_linear_scan (prefill)",
            lambda: diag_linear_scan(a, lb, cu, h0),
            total * d_hidden * (2 * size + 4),
            compile_reference=False,  # a sequential Python loop over T: compiling it unrolls T steps
            reference_capturable=False,
        ),
        Case("causal_conv1d_varlen (prefill)", lambda: causal_conv1d_varlen(x_seq, w, bias, cu, conv0),
             2 * total * d_model * size),
        Case("add_norm (prefill rows)", lambda: add_norm(rows, x_seq, ln_w, ln_b, 1e-5), 4 * total * d_model * size),
        Case("diag_scan_step (decode)", lambda: diag_scan_step(step_a, step_b, h_pool, slots),
             2 * batch * d_hidden * size + state_rw + batch * d_hidden * 4),
        Case("min_rnn_step mingru (decode)", lambda: min_rnn_step(proj, h_pool, slots, "mingru"),
             3 * batch * d_hidden * size + state_rw),
        Case("causal_conv1d_update (decode)", lambda: causal_conv1d_update(x_tok, conv_pool, w, bias, slots),
             2 * batch * d_model * size + 2 * batch * d_model * (width - 1) * 4),
        Case("add_norm (decode rows)", lambda: add_norm(x_tok, x_tok, ln_w, ln_b, 1e-5), 4 * batch * d_model * size),
    ]


def on_reference_path(fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` with every public kernel function forced onto its PyTorch reference."""

    def run() -> object:
        with force_triton(False):
            return fn()

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on CPU, reference path only")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile of the references")
    parser.add_argument("--min-seconds", type=float, default=0.2, help="time each variant at least this long")
    args = parser.parse_args()
    if not args.cpu_smoke and not torch.cuda.is_available():
        parser.error("no CUDA device: use --cpu-smoke")
    device = torch.device("cpu" if args.cpu_smoke else "cuda")
    if device.type == "cpu":
        build_cpu_extension()  # before timing: on CPU the conv's non-Triton path is its C++ kernel
    dtype = torch.float32 if args.cpu_smoke else DTYPES[args.dtype]
    min_seconds = 0.02 if args.cpu_smoke else args.min_seconds
    peak = peak_bandwidth(device, (16 if args.cpu_smoke else 1024) * 2**20, min_seconds)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print(f"{name}: device-to-device copy {peak / 1e9:.0f} GB/s (the peak below); dtype {dtype}")
    print(f"{'op':34} {'impl':10} {'time us':>10} {'GB/s':>8} {'of peak':>8} {'vs ref':>7}")
    for case in cases(device, dtype, small=args.cpu_smoke):
        variants: dict[str, Callable[[], object]] = {"reference": on_reference_path(case.run)}
        if device.type == "cuda":
            if case.compile_reference and not args.no_compile:
                variants["compiled"] = on_reference_path(torch.compile(case.run, dynamic=False))
            variants["triton"] = case.run
        base = None
        for impl, fn in variants.items():
            try:
                capturable = impl == "triton" or case.reference_capturable
                seconds, from_graph = timed_on_device(fn, device, min_seconds, capturable)
            except Exception as error:  # noqa: BLE001 - a failed compile is a result to report, not a crash
                print(f"{case.name:34} {impl:10} failed: {type(error).__name__}: {str(error)[:60]}")
                continue
            base = base or seconds
            rate = case.nbytes / seconds
            mark = "" if from_graph or device.type != "cuda" else "  (eager: includes launch overhead)"
            print(f"{case.name:34} {impl:10} {seconds * 1e6:10.1f} {rate / 1e9:8.1f} {rate / peak:8.1%} "
                  f"{base / seconds:6.2f}x{mark}")


if __name__ == "__main__":
    with torch.inference_mode():
        main()
