"""Weight-only quantization (``--quantize int8`` / ``int4``): the quality it costs and the decode speed it buys,
in one run.

Quality, on the embedded default model (the byte-level minGRU that ``LLM()`` loads), fp32 vs int8 and int4:

* perplexity per byte (and bits per byte) of held-out English: :data:`HELD_OUT`, passages written for this
  benchmark (not from the model's training corpus, Debian's ``fortunes``), each read in one teacher-forced
  prefill after an EOS;
* teacher-forced top-1 agreement over the same text;
* greedy agreement on :data:`PROMPTS` (16 prompts x 64 tokens, EOS ignored): the fraction of tokens generated
  before the first divergence, and the fraction of positions with the same token overall.

Speed, on ``--speed-model`` (random ``mamba-130m`` weights by default): engine decode tok/s at batch 1, 8 and 32
for fp32, bf16, and int8 and int4 each on fp32 activations (an fp32 model quantized) and on bf16 activations (a
bf16 model quantized), measured interleaved in the same process, with the weight bytes one step reads and
the roofline those bytes allow at the read bandwidth measured in the same run.

    python benchmarks/quantization.py [--speed-model random:mamba-130m] [--threads 2] [--steps 16] [--repeats 3]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch

# Runs from a checkout without installing: rnnserve finds its folders beside rnnserve/.
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.cpu_peers import greedy_tokens, read_bandwidth, step_bytes
from rnnserve.engine.config import EngineConfig
from rnnserve.engine.llm_engine import LLMEngine
from rnnserve.engine.models.base import PrefillBatch
from rnnserve.engine.sampling_params import OutputKind, SamplingParams
from rnnserve.engine.state_pool import StatePool

EOS = 256  # the default model's end-of-text id; each passage is read after it, as a fortune follows one

HELD_OUT = [
    "The library on the corner opens at nine, but the old man is always there before the doors are unlocked. "
    "He brings a thermos of tea and a newspaper, and he reads the same page twice while he waits. When the "
    "librarian finally arrives, he greets her by name and asks what new books came in this week.",
    "There is no such thing as a small mistake in a recipe for bread. Too much salt and the dough will not "
    "rise; too little water and the crust will crack before the inside is done. Patience is the one "
    "ingredient that every baker must add by hand, and it cannot be measured with a spoon.",
    "When the storm finally passed, the village came out to count the damage. A few roofs had lost their "
    "tiles, the river had covered the lower road, and the bridge was gone. Nobody was hurt, and by the "
    "evening the children were already throwing stones into the new lake in the middle of the field.",
    "A good teacher does not give you the answer. She asks you a question you did not think to ask, and "
    "then she waits. It may take a minute or a year, but the answer you find that way is one you will "
    "never forget, because it was yours from the start.",
    "The computer was older than most of the people who used it, and it made a sound like a tired horse "
    "whenever it started. Still, it never lost a file, and on the day the new system failed, everyone in "
    "the office stood behind the old machine and watched it print the payroll, one line at a time.",
    "If you want to know what a man is really like, watch how he treats the people who can do nothing for "
    "him. Money and power only make the truth easier to see. A kind word to a waiter says more than a "
    "long speech to a crowd.",
]

PROMPTS = [
    "The ",
    "A man ",
    "Love is ",
    "In the beginning ",
    "Never ",
    "When I was young, ",
    "Money ",
    "The best way to ",
    "Why ",
    "There are two kinds of ",
    "My father ",
    "Life is ",
    "If you ",
    "The computer ",
    "Every ",
    "Do not ",
]


def perplexity_and_agreement(engines: dict[str, LLMEngine]) -> dict[str, dict[str, float]]:
    """Per-byte perplexity of :data:`HELD_OUT` for each engine's model, and the top-1 agreement of each with the
    first (the fp32 reference)."""
    nll = dict.fromkeys(engines, 0.0)
    agree = dict.fromkeys(engines, 0)
    total = 0
    for text in HELD_OUT:
        ids = torch.tensor([EOS, *text.encode()])
        logits = {}
        for name, engine in engines.items():
            model = engine.model
            state = StatePool(model.state_spec(), 1).tensors
            with torch.inference_mode():
                out = model.prefill(PrefillBatch.build([ids[:-1]], [0], all_logits=[True]), state)
            logits[name] = out.float()
            nll[name] -= torch.log_softmax(out.float(), -1).gather(1, ids[1:, None]).sum().item()
        reference = next(iter(logits.values())).argmax(-1)
        for name in engines:
            agree[name] += int((logits[name].argmax(-1) == reference).sum())
        total += ids.numel() - 1
    return {
        name: {
            "ppl": math.exp(nll[name] / total),
            "bpb": nll[name] / total / math.log(2),
            "top1": agree[name] / total,
            "bytes": total,
        }
        for name in engines
    }


def greedy_agreement(fp32: LLMEngine, int8: LLMEngine, new_tokens: int) -> dict[str, float]:
    """Greedy continuations of :data:`PROMPTS`: the identical prefix (until the first divergence) and the
    identical positions overall, as fractions of all generated tokens."""
    prompts = [fp32.tokenizer.encode(p) for p in PROMPTS]
    ours, theirs = greedy_tokens(fp32, prompts, new_tokens), greedy_tokens(int8, prompts, new_tokens)
    prefix = same = 0
    for a, b in zip(ours, theirs, strict=True):
        first_diff = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
        prefix += first_diff
        same += sum(x == y for x, y in zip(a, b, strict=True))
    count = len(prompts) * new_tokens
    identical = sum(a == b for a, b in zip(ours, theirs, strict=True))
    return {"prefix": prefix / count, "overall": same / count, "identical": identical}


def decode_rate(engine: LLMEngine, batch: int, steps: int) -> float:
    """Generated tok/s over ``steps`` engine steps that decode ``batch`` requests each (prefilled first, untimed).

    The prompts are byte strings, so any model with a byte-level tokenizer (the ``random:`` presets) takes them."""
    params = SamplingParams(temperature=0, max_tokens=steps + 4, ignore_eos=True, output_kind=OutputKind.FINAL_ONLY)
    ids = [engine.add_request(f"Prompt {i}: ", params) for i in range(batch)]
    try:
        engine.step()
        while engine.last_step.decode_batch_size != batch or engine.last_step.prefill_tokens:
            engine.step()
        start = time.perf_counter()
        generated = 0
        for _ in range(steps):
            engine.step()
            generated += engine.last_step.generated_tokens
        return generated / (time.perf_counter() - start)
    finally:
        for request_id in ids:
            engine.abort_request(request_id)


def quality_section() -> None:
    def engine(quantize: str | None) -> LLMEngine:
        return LLMEngine.from_config(EngineConfig(device="cpu", quantize=quantize, max_num_seqs=len(PROMPTS)))

    engines = {"fp32": engine(None), "int8": engine("int8"), "int4": engine("int4")}
    quality = perplexity_and_agreement(engines)
    fp32 = quality["fp32"]
    print(f"## Quality: embedded default model ({engines['fp32'].model.architecture}), fp32 vs int8 and int4\n")
    print(f"held-out text: {len(HELD_OUT)} passages written for this benchmark, {fp32['bytes']} bytes\n")
    print("| | perplexity per byte | ratio | bits per byte | teacher-forced top-1 agreement | greedy prefix | "
          "greedy positions | identical continuations |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, values in quality.items():
        greedy = greedy_agreement(engines["fp32"], engines[name], 64)
        print(
            f"| {name} | {values['ppl']:.4f} | {values['ppl'] / fp32['ppl']:.4f} | {values['bpb']:.4f} | "
            f"{values['top1']:.4f} | {greedy['prefix']:.4f} | {greedy['overall']:.4f} | "
            f"{greedy['identical']}/{len(PROMPTS)} |"
        )
    print(f"\n(greedy: {len(PROMPTS)} prompts x 64 tokens against fp32; prefix = tokens before the first divergence)\n")


def speed_section(model: str, threads: int, steps: int, repeats: int, batches: list[int]) -> None:
    variants = {
        "fp32": ("float32", None),
        "bf16": ("bfloat16", None),
        "int8": ("float32", "int8"),
        "int8 on bf16": ("bfloat16", "int8"),
        "int4": ("float32", "int4"),
        "int4 on bf16": ("bfloat16", "int4"),
    }
    engines = {
        name: LLMEngine.from_config(
            EngineConfig(model=model, device="cpu", dtype=dtype, quantize=quantize, max_num_seqs=max(batches))
        )
        for name, (dtype, quantize) in variants.items()
    }
    bandwidth = read_bandwidth()
    rates: dict[tuple[str, int], list[float]] = {}
    for _ in range(repeats):  # interleaved, so that load from elsewhere hits every variant alike
        for batch in batches:
            for name, engine in engines.items():
                rates.setdefault((name, batch), []).append(decode_rate(engine, batch, steps))
    print(f"## Decode speed: {model}, {threads} threads, engine decode tok/s (best / median of {repeats})\n")
    print(f"read bandwidth (torch.sum over 1 GiB, best of 5): {bandwidth / 1e9:.1f} GB/s\n")
    print(
        "| variant | weight bytes/step | roofline tok/s (batch 1) | "
        + " | ".join(f"batch {b}" for b in batches)
        + " | batch 1 vs roofline |"
    )
    print("| --- | --- | --- | " + " | ".join("---" for _ in batches) + " | --- |")
    for name, engine in engines.items():
        nbytes = step_bytes(engine.model)
        roofline = bandwidth / nbytes
        cells = [f"{max(rates[name, b]):.1f} / {statistics.median(rates[name, b]):.1f}" for b in batches]
        fraction = max(rates[name, batches[0]]) / roofline if batches[0] == 1 else float("nan")
        print(f"| {name} | {nbytes / 1e6:.1f} MB | {roofline:.1f} | " + " | ".join(cells) + f" | {fraction:.2f} |")
    print("\nratios (best of each):")
    for batch in batches:
        best = {name: max(rates[name, batch]) for name in engines}
        print(
            f"  batch {batch}: int8/fp32 {best['int8'] / best['fp32']:.2f}x, "
            f"int4/fp32 {best['int4'] / best['fp32']:.2f}x, "
            f"int8 on bf16/bf16 {best['int8 on bf16'] / best['bf16']:.2f}x, "
            f"int4 on bf16/bf16 {best['int4 on bf16'] / best['bf16']:.2f}x, "
            f"int4/int8 {best['int4'] / best['int8']:.2f}x, int4 on bf16/int8 on bf16 "
            f"{best['int4 on bf16'] / best['int8 on bf16']:.2f}x"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--speed-model", default="random:mamba-130m")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--steps", type=int, default=16, help="timed decode steps per measurement")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--skip-speed", action="store_true", help="quality only")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    quality_section()
    if not args.skip_speed:
        speed_section(args.speed_model, args.threads, args.steps, args.repeats, args.batches)
    print(f"\n({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
