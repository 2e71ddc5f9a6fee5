"""Times the fused CPU kernels that evaluate ``fast_exp`` (sigmoid, SiLU, softplus, tanh, the scans' exp), and the
Lattice scan (its per-slot tests for columns it keeps), for two builds of the extension, alternating between them,
and prints each kernel's time ratio (second / first).

    python benchmarks/cpu_exp_kernels.py BASE.so NEW.so [--rounds 5]

Each round runs every kernel in a fresh process per build (the two builds register the same op names), one
thread, the builds' order swapped every round; the ratio is of the medians over rounds of each process's
best-of-repeats time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch


def cases() -> dict[str, Callable[[], object]]:
    """Each kernel on a prefill- or decode-sized input, through the public wrappers."""
    from rnnserve.kernels.causal_conv1d import causal_conv1d_varlen
    from rnnserve.kernels.diag_linear_scan import diag_log_scan
    from rnnserve.kernels.gated_act import gated_act
    from rnnserve.kernels.gated_rms_norm import gated_rms_norm
    from rnnserve.kernels.lattice import lattice_varlen
    from rnnserve.kernels.min_rnn_step import min_rnn_scan, min_rnn_step
    from rnnserve.kernels.rg_lru import rg_lru_scan
    from rnnserve.kernels.selective_scan import selective_scan_varlen, selective_state_update

    g = torch.Generator().manual_seed(0)
    tokens, dim = 512, 1536
    cu = torch.tensor([0, tokens])
    proj2, proj3 = torch.randn(tokens, 2 * dim, generator=g), torch.randn(tokens, 3 * dim, generator=g)
    h0 = torch.rand(1, dim, generator=g)
    step_proj, pool, rows = torch.randn(32, 2 * dim, generator=g), torch.rand(64, dim, generator=g), torch.arange(32)
    act = torch.randn(tokens, dim, generator=g).bfloat16()
    conv_x, conv_w = torch.randn(tokens, dim, generator=g), torch.randn(dim, 4, generator=g)
    gz = torch.randn(tokens, dim, generator=g)
    norm_w = torch.rand(dim, generator=g)
    d_inner, d_state = 768, 16
    ss = {
        "x": torch.randn(tokens, d_inner, generator=g),
        "dt": torch.randn(tokens, d_inner, generator=g),
        "A": -torch.rand(d_inner, d_state, generator=g) * 4,
        "B": torch.randn(tokens, d_state, generator=g),
        "C": torch.randn(tokens, d_state, generator=g),
        "D": torch.randn(d_inner, generator=g),
        "z": torch.randn(tokens, d_inner, generator=g),
        "dt_bias": torch.randn(d_inner, generator=g),
    }
    ss_pool = torch.randn(64, d_inner, d_state, generator=g)
    ss_step = {name: t[:32] if t.shape[0] == tokens else t for name, t in ss.items()}
    heads, width = 12, 128
    lru_w = (
        torch.randn(heads, width, width, generator=g) / width**0.5,
        torch.randn(heads, width, generator=g),
        torch.randn(heads, width, width, generator=g) / width**0.5,
        torch.randn(heads, width, generator=g),
        torch.randn(dim, generator=g),
    )
    first = torch.zeros(tokens, dtype=torch.bool)
    first[0] = True
    log_a, log_b = -torch.rand(tokens, dim, generator=g) * 3, torch.randn(tokens, dim, generator=g)
    lattice_heads, lattice_dim, lattice_slots = 12, 64, 24  # 24 slots: padded to whole vectors
    lattice_qk = [torch.randn(tokens, lattice_heads, lattice_slots, generator=g) for _ in range(2)]
    lattice_v = torch.randn(tokens, lattice_heads, lattice_dim, generator=g)
    lattice_gates = torch.rand(tokens, lattice_heads, generator=g)
    lattice_pool = torch.randn(1, lattice_heads, lattice_dim, lattice_slots, generator=g)
    lattice_pool /= lattice_pool.norm(dim=2, keepdim=True)
    lattice_slot = torch.zeros(1, dtype=torch.long)
    return {
        "min_rnn_scan mingru 512x1536": lambda: min_rnn_scan(proj2, cu, h0, "mingru"),
        "min_rnn_scan minlstm 512x1536": lambda: min_rnn_scan(proj3, cu, h0, "minlstm"),
        "min_rnn_step mingru 32x1536": lambda: min_rnn_step(step_proj, pool, rows, "mingru"),
        "selective_scan 512x768x16": lambda: selective_scan_varlen(
            **ss, cu_seqlens=cu, initial_state=torch.zeros(1, d_inner, d_state), dt_softplus=True
        ),
        "selective_state_update 32x768x16": lambda: selective_state_update(
            ss_pool, slice(0, 32), **ss_step, dt_softplus=True
        ),
        "rg_lru_scan 512x1536": lambda: rg_lru_scan(conv_x, first, cu, h0.clone(), *lru_w),
        "diag_log_scan 512x1536": lambda: diag_log_scan(log_a, log_b, cu, h0),
        "gated_act silu bf16 512x1536": lambda: gated_act(act, act, "silu"),
        "gated_act gelu_tanh bf16 512x1536": lambda: gated_act(act, act, "gelu_tanh"),
        "causal_conv1d silu 512x1536": lambda: causal_conv1d_varlen(conv_x, conv_w, None, cu, silu=True),
        "gated_rms_norm 512x1536": lambda: gated_rms_norm(conv_x, gz, norm_w, 4, 1e-5),
        "lattice_varlen dec 512x12x64x24": lambda: lattice_varlen(
            *lattice_qk, lattice_v, lattice_gates, lattice_gates, cu, lattice_pool.clone(), lattice_slot, "dec"
        ),
    }


def run_one(library: str, repeats: int) -> dict[str, float]:
    """Load ``library`` as the extension and time every case: best of ``repeats`` runs of a timed loop, in ms."""
    from rnnserve.kernels import cpu_extension

    torch.ops.load_library(library)
    cpu_extension._built = True
    torch.set_num_threads(1)
    times = {}
    with torch.inference_mode():
        for name, fn in cases().items():
            fn()
            best = float("inf")
            for _ in range(repeats):
                start = time.perf_counter()
                for _ in range(5):
                    fn()
                best = min(best, (time.perf_counter() - start) / 5)
            times[name] = best * 1e3
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("base")
    parser.add_argument("new")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_one(args.base, args.repeats)))
        return
    results: dict[str, list[dict[str, float]]] = {args.base: [], args.new: []}
    for round_index in range(args.rounds):
        # The process that runs second was slower on a loaded VM whichever build it loaded: each round swaps.
        order = (args.base, args.new) if round_index % 2 == 0 else (args.new, args.base)
        for library in order:
            out = subprocess.run([sys.executable, __file__, library, library, "--child", "--repeats",
                                  str(args.repeats)], capture_output=True, text=True, check=True).stdout  # fmt: skip
            results[library].append(json.loads(out.splitlines()[-1]))
    print(f"{'kernel':36} {'base ms':>9} {'new ms':>9} {'new/base':>9}")
    for name in results[args.base][0]:
        base = statistics.median(r[name] for r in results[args.base])
        new = statistics.median(r[name] for r in results[args.new])
        print(f"{name:36} {base:9.3f} {new:9.3f} {new / base:9.3f}")


if __name__ == "__main__":
    main()
