"""oneDNN's row counts bucketed (``onednn_rows``) against the rows as they come, in one process, alternating.

An engine (``--model``, no prefix cache) prefills ``--requests`` times 1-4 prompts of ``--max-len`` tokens
(``--lengths fixed``) or of 1 to ``--max-len`` tokens (``random``), two tokens each, with the fp32 products past
the GEMV kernel padded to ``onednn_rows`` or not; the arms alternate round by round, each round with the same
prompts for both. Printed: the median process CPU time of each arm and their ratio. One torch thread by default:
on a shared machine, OpenMP's spinning made CPU times of one arm vary 5x between rounds.

    python benchmarks/onednn_rows.py [--model NAME] [--max-len 600] [--lengths random|fixed] [--rounds 10]
"""

from __future__ import annotations

import argparse
import importlib
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from rnnserve.engine.config import EngineConfig
from rnnserve.engine.llm_engine import LLMEngine
from rnnserve.engine.sampling_params import SamplingParams

linear_module = importlib.import_module("rnnserve.engine.models.layers.linear")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the embedded model")
    parser.add_argument("--max-len", type=int, default=600)
    parser.add_argument("--lengths", choices=["random", "fixed"], default="random")
    parser.add_argument("--requests", type=int, default=15)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    engine = LLMEngine.from_config(EngineConfig(model=args.model, max_num_seqs=8, enable_prefix_cache=False))
    bucketed = linear_module.onednn_rows
    arms = {"as is": lambda rows: rows, "bucketed": bucketed}

    def run(seed: int) -> float:
        rng = random.Random(seed)
        start = time.process_time()
        for _ in range(args.requests):
            for _ in range(rng.randint(1, 4)):
                length = args.max_len if args.lengths == "fixed" else rng.randint(1, args.max_len)
                prompt = [rng.randint(0, 255) for _ in range(length)]
                engine.add_request(prompt, SamplingParams(max_tokens=2, temperature=0))
            while engine.has_unfinished_requests():
                engine.step()
        return time.process_time() - start

    for rows in arms.values():  # warm-up: each arm's shapes built once
        linear_module.onednn_rows = rows
        run(-1)
    times: dict[str, list[float]] = {name: [] for name in arms}
    for index in range(args.rounds):
        for name in list(arms)[:: 1 if index % 2 == 0 else -1]:
            linear_module.onednn_rows = arms[name]
            times[name].append(run(index))
    linear_module.onednn_rows = bucketed
    base, new = statistics.median(times["as is"]), statistics.median(times["bucketed"])
    print(f"{args.model or 'default model'}, {args.lengths} lengths to {args.max_len}: as is {base:.3f} s, "
          f"bucketed {new:.3f} s, bucketed / as is {new / base:.3f}")


if __name__ == "__main__":
    main()
