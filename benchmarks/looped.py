"""Looped transformers at the paper's language-model scale: decode cost vs the loop count r, and state per slot.

Decode: ``random:looped-wt103`` / ``random:tmlt-wt103`` (width 768, 12 heads, block size 1024, GPT-2 vocabulary)
with ``n_loop`` set to each r, one decode step for a batch whose sequences sit at position ``--context`` (the
attention reads that many cached rows per loop). Reported: ms per step, tokens/s, the step time relative to the
first r, and the cost of one more loop, ``(t_r - t_1) / (r - 1)``: flat when the step time is linear in r (the
embedding and the LM head are paid once per step). All configurations are timed in interleaved rounds of the
same run, the fastest round counting. On CUDA, each batch also runs as the captured CUDA graph.

State: bytes per slot of the looped model (K and V of every loop for ``block_size`` positions) against a
standard transformer of equal depth (r layers of the same width, same block size) and against the paper's
baseline transformer (6 layers, width 512), with the parameter counts.

    python benchmarks/looped.py [--device cpu|cuda] [--loops 1 4 12 24] [--batches 1 8] [--context 256]
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
from rnnserve.engine.models import MODEL_REGISTRY, PRESETS  # noqa: E402
from rnnserve.engine.models.base import DecodeBatch, RecurrentLM  # noqa: E402
from rnnserve.engine.state_pool import StatePool  # noqa: E402
from rnnserve.kernels.cpu_extension import build_cpu_extension  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
MIB = 2**20


def seconds_per_step(step: Callable[[], object], device: torch.device, steps: int) -> float:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    return (time.perf_counter() - start) / steps


def build(preset: str, loops: int, device: torch.device, dtype: torch.dtype) -> RecurrentLM:
    architecture, overrides = PRESETS[preset]
    cls = MODEL_REGISTRY[architecture]
    model = cls(cls.config_class(**{**overrides, "n_loop": loops}))
    model.init_weights(torch.Generator().manual_seed(0))
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)


def decode_steps(
    model: RecurrentLM, batch: int, context: int, device: torch.device
) -> dict[str, Callable[[], object]]:
    """Decode-step callables for ``batch`` sequences at position ``context``: eager, and a CUDA graph on CUDA."""
    pool = StatePool(model.state_spec(), batch, device)
    for tensor in pool.tensors.values():
        tensor.normal_()
    ids = torch.randint(0, model.vocab_size, (batch,), device=device)
    decode = DecodeBatch(ids, torch.arange(batch, device=device), torch.full((batch,), context, device=device))
    steps: dict[str, Callable[[], object]] = {"eager": lambda: model.decode(decode, pool.tensors)}
    if device.type == "cuda":
        graphs = CUDAGraphDecodeRunner(model, pool.tensors, pool.scratch_slot, batch)
        graphs.capture()
        steps["graph"] = lambda: graphs(decode)
    return steps


def decode_rows(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> None:
    """All configurations are built first and timed in interleaved rounds (the fastest round counts), so that
    a noisy machine slows every r alike."""
    print(f"decode, {args.preset}, {dtype}, {device}, context {args.context} tokens, best of {args.repeats} rounds")
    print(f"{'r':>3} {'batch':>5} {'mode':6} {'ms/step':>9} {'tokens/s':>10} {'vs r=1':>7} {'ms/extra loop':>14}")
    cases: dict[tuple[int, int, str], Callable[[], object]] = {}
    with torch.inference_mode():
        for loops in args.loops:
            model = build(args.preset, loops, device, dtype)
            for batch in args.batches:
                for mode, step in decode_steps(model, batch, args.context, device).items():
                    cases[(loops, batch, mode)] = step
                    step()  # warm-up
        best = dict.fromkeys(cases, float("inf"))
        for _ in range(args.repeats):
            for key, step in cases.items():
                best[key] = min(best[key], seconds_per_step(step, device, args.steps))
    first = args.loops[0]
    for (loops, batch, mode), seconds in best.items():
        base = best[(first, batch, mode)]
        extra = (seconds - base) / (loops - first) if loops > first else float("nan")
        print(f"{loops:>3} {batch:>5} {mode:6} {seconds * 1e3:>9.2f} {batch / seconds:>10.1f} "
              f"{seconds / base:>6.2f}x {extra * 1e3:>14.3f}")


def params_of_standard_transformer(width: int, layers: int, vocab: int, block: int) -> int:
    """GPT-2-style: per layer 4 d^2 attention + 8 d^2 MLP weights; tied embedding; learned positions."""
    return layers * 12 * width * width + vocab * width + block * width


def state_rows(args: argparse.Namespace, dtype: torch.dtype) -> None:
    _, overrides = PRESETS[args.preset]
    width, block, vocab = overrides["n_embd"], overrides["block_size"], overrides["vocab_size"]
    size = torch.empty((), dtype=dtype).element_size()
    paper_tf = 2 * 6 * block * 512 * size
    print(f"\nstate per slot ({dtype}, block size {block}); paper's baseline transformer (6 x 512): "
          f"{paper_tf / MIB:.1f} MiB, {params_of_standard_transformer(512, 6, vocab, block) / 1e6:.1f} M params")
    print(f"{'r':>3} {'looped MiB':>11} {'TF(L=r) MiB':>12} {'ratio':>6} {'looped params':>14} {'TF(L=r) params':>15}")
    for loops in args.loops:
        with torch.device("meta"):
            model = build(args.preset, loops, torch.device("meta"), dtype)  # shapes only
        looped = sum(s.nbytes for s in model.state_spec())
        standard = 2 * loops * block * width * size
        params = sum(p.numel() for p in model.parameters())
        print(f"{loops:>3} {looped / MIB:>11.1f} {standard / MIB:>12.1f} {looped / standard:>6.2f} "
              f"{params / 1e6:>13.1f}M {params_of_standard_transformer(width, loops, vocab, block) / 1e6:>14.1f}M")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--preset", default="looped-wt103", choices=["looped-wt103", "tmlt-wt103"])
    parser.add_argument("--loops", nargs="+", type=int, default=[1, 4, 12, 24])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--context", type=int, default=256, help="position of the decoded token (cached rows read)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: fp32 on CPU, bf16 on CUDA")
    parser.add_argument("--steps", type=int, default=5, help="decode steps per timing")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved rounds; the fastest is reported")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device")
    dtype = DTYPES[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    torch.manual_seed(0)
    if device.type == "cpu":
        build_cpu_extension()  # the fused CPU kernels the final norm uses, built before timing
    decode_rows(args, device, dtype)
    state_rows(args, dtype)


if __name__ == "__main__":
    main()
