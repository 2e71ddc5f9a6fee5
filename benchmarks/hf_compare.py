"""rnnserve vs ``transformers`` generate on the same Mamba weights (CPU, fp32 by default).

For ``random:mamba-130m`` (the real 130M shape: d_model 768, 24 layers, vocab 50280) both engines get the
same prompts (64 random tokens each) at batch 1 and 32 and greedily generate 32 new tokens. Reported:

* end-to-end tok/s: generated tokens / wall time of the whole request (prefill included);
* decode tok/s: the extra tokens (31 per sequence) over the extra time of a 32-token run vs a 1-token run,
  i.e. steady-state generation speed without the prompt.

Each measurement is the fastest of ``--repeats`` runs, the two engines' runs interleaved: these shared
machines lose up to a quarter of their CPU time to neighbours for seconds at a time, and the minimum is the
run least disturbed by that.

Usage: ``python benchmarks/hf_compare.py [--model random:mamba-130m] [--batches 1 32] [--repeats 3] [--profile]``.
``transformers`` is a test/benchmark dependency only.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Runs from a checkout without installing: rnnserve finds its folders beside rnnserve/.
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import argparse  # noqa: E402
import os  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from rnnserve.engine.config import EngineConfig  # noqa: E402
from rnnserve.engine.llm_engine import LLMEngine  # noqa: E402
from rnnserve.engine.loader import load_model  # noqa: E402
from rnnserve.engine.sampling_params import SamplingParams  # noqa: E402


def hf_reference(model: torch.nn.Module) -> torch.nn.Module:
    """A ``transformers`` MambaForCausalLM holding exactly our weights."""
    import transformers

    c = model.config
    config = transformers.MambaConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.d_model,
        num_hidden_layers=c.n_layers,
        state_size=c.d_state,
        intermediate_size=c.d_inner,
        conv_kernel=c.d_conv,
        time_step_rank=c.dt_rank,
        use_bias=c.use_bias,
        use_conv_bias=c.use_conv_bias,
        layer_norm_epsilon=c.norm_eps,
        tie_word_embeddings=c.tie_embeddings,
    )
    config.intermediate_size = c.d_inner
    reference = transformers.MambaForCausalLM(config).eval()
    reference.load_state_dict(model.state_dict())
    return reference.to(next(model.parameters()).dtype)


def run_rnnserve(
    model, tokenizer, prompts: list[list[int]], new_tokens: int
) -> tuple[float, list[list[int]]]:
    engine = LLMEngine(
        model,
        tokenizer,
        EngineConfig(max_num_seqs=len(prompts), max_num_batched_tokens=sum(map(len, prompts))),
    )
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    ids = [engine.add_request(p, params) for p in prompts]
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out.outputs[0].token_ids
    return time.perf_counter() - start, [final[i] for i in ids]


@torch.inference_mode()
def run_transformers(reference, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
    ids = torch.tensor(prompts)
    start = time.perf_counter()
    out = reference.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=new_tokens,
        eos_token_id=None,
        pad_token_id=0,
    )
    return time.perf_counter() - start, out[:, ids.shape[1] :].tolist()


def measure(args: argparse.Namespace, dtype: str) -> list[tuple]:
    """Both engines on the same weights in ``dtype``; one row per batch size."""
    model, tokenizer = load_model(args.model, device="cpu", dtype=dtype)
    reference = hf_reference(model)
    g = torch.Generator().manual_seed(0)
    n = args.new_tokens
    run_rnnserve(model, tokenizer, [[1, 2, 3]], 2)
    run_transformers(reference, [[1, 2, 3]], 2)
    rows = []
    # Prompt ids the tokenizer can decode (the engine rejects others; a random preset's byte tokenizer
    # covers fewer ids than its model's vocabulary). Speed does not depend on which ids they are.
    prompt_vocab = min(model.vocab_size, tokenizer.vocab_size)
    for batch in args.batches:
        prompts = torch.randint(0, prompt_vocab, (batch, args.prompt_len), generator=g).tolist()
        times: dict[str, list[float]] = {"ours_full": [], "ours_first": [], "hf_full": [], "hf_first": []}
        for _ in range(args.repeats):
            elapsed, ours_tokens = run_rnnserve(model, tokenizer, prompts, n)
            times["ours_full"].append(elapsed)
            times["ours_first"].append(run_rnnserve(model, tokenizer, prompts, 1)[0])
            elapsed, hf_tokens = run_transformers(reference, prompts, n)
            times["hf_full"].append(elapsed)
            times["hf_first"].append(run_transformers(reference, prompts, 1)[0])
        ours_full, ours_first, hf_full, hf_first = (min(times[k]) for k in times)
        rows.append((dtype, batch, ours_full, ours_first, hf_full, hf_first, ours_tokens == hf_tokens))
        print(f"  {dtype} batch {batch} done", flush=True)
    if args.profile and dtype == args.dtypes[0]:
        prompts = torch.randint(0, prompt_vocab, (max(args.batches), args.prompt_len), generator=g).tolist()
        with torch.profiler.profile() as prof:
            run_rnnserve(model, tokenizer, prompts, n)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="random:mamba-130m")
    parser.add_argument(
        "--dtypes",
        nargs="+",
        default=["float32"],
        help="weight dtypes, e.g. float32 bfloat16 (states stay fp32)",
    )
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3, help="runs per measurement; the fastest counts")
    parser.add_argument("--threads", type=int, default=None, help="torch threads for both engines")
    parser.add_argument(
        "--profile", action="store_true", help="profile one rnnserve run at the largest batch"
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    n = args.new_tokens
    print(
        f"model {args.model}, {torch.get_num_threads()} threads, prompt {args.prompt_len}, {n} new tokens, "
        f"best of {args.repeats}, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'default')}"
    )
    rows = [row for dtype in args.dtypes for row in measure(args, dtype)]

    print(
        f"\n{'dtype':<9} | {'batch':>5} | {'engine':<12} | {'end-to-end tok/s':>16} | {'decode tok/s':>12} | "
        "rnnserve speedup (e2e / decode)"
    )
    print("-" * 104)
    for dtype, batch, ours_full, ours_first, hf_full, hf_first, same in rows:
        ours_e2e, hf_e2e = batch * n / ours_full, batch * n / hf_full
        ours_dec = batch * (n - 1) / max(ours_full - ours_first, 1e-9)
        hf_dec = batch * (n - 1) / max(hf_full - hf_first, 1e-9)
        print(f"{dtype:<9} | {batch:>5} | {'transformers':<12} | {hf_e2e:>16.1f} | {hf_dec:>12.1f} |")
        print(
            f"{dtype:<9} | {batch:>5} | {'rnnserve':<12} | {ours_e2e:>16.1f} | {ours_dec:>12.1f} | "
            f"{ours_e2e / hf_e2e:>6.1f}x / {ours_dec / hf_dec:.1f}x   (greedy tokens identical: "
            f"{'yes' if same else 'NO'})"
        )


if __name__ == "__main__":
    main()
