"""The vLLM side of ``benchmarks/cpu_peers.py``; runs under an interpreter with a vLLM CPU build, not rnnserve's.

Loads one checkpoint (token-id prompts, no tokenizer), prints ``READY``, then answers each JSON request read
from stdin with one ``RESULT <json>`` line on stdout, so the caller can alternate it with rnnserve:

- ``{"batch": B, "seed": S}`` -> ``{"tok_s": ...}``: decode tok/s of B random ``--prompt-len`` prompts, i.e.
  ``B * steps`` over the time a ``generate`` with ``steps + 1`` new tokens takes beyond one with 1 new token
  (the same prompts, so prefill cancels out);
- ``{"greedy": [[ids], ...], "new_tokens": N}`` -> ``{"tokens": [[ids], ...]}``: greedy continuations.

    <vllm python> benchmarks/cpu_peers_vllm.py --model DIR --dtype float32 --prompt-len 64 --steps 64 --max-batch 32
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="Hugging Face checkpoint directory")
    parser.add_argument("--dtype", required=True, choices=["float32", "bfloat16"])
    parser.add_argument("--prompt-len", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True, help="decode steps timed per request")
    parser.add_argument("--max-batch", type=int, required=True)
    parser.add_argument("--vocab-size", type=int, required=True, help="random prompt ids are drawn below this")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=args.model,
        skip_tokenizer_init=True,
        dtype=args.dtype,
        max_model_len=args.prompt_len + args.steps + 128,
        max_num_seqs=args.max_batch,
        gpu_memory_utilization=0.3,
        seed=0,
    )

    def generate(prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True, detokenize=False)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(out.outputs[0].token_ids) for out in outputs]

    def decode_rate(batch: int, seed: int) -> float:
        rng = random.Random(seed)
        prompts = [[rng.randrange(args.vocab_size) for _ in range(args.prompt_len)] for _ in range(batch)]
        start = time.perf_counter()
        generate(prompts, 1)
        first = time.perf_counter() - start
        start = time.perf_counter()
        generate(prompts, args.steps + 1)
        whole = time.perf_counter() - start
        return batch * args.steps / (whole - first)

    decode_rate(1, -1)  # warm-up
    print("READY", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        if "greedy" in request:
            reply = {"tokens": generate(request["greedy"], request["new_tokens"])}
        else:
            reply = {"tok_s": decode_rate(request["batch"], request["seed"])}
        print("RESULT " + json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
