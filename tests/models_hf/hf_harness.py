"""Shared checks for Hugging Face format models: rnnserve vs ``transformers`` on the same checkpoint.

Each architecture's test module builds tiny ``transformers`` models (random weights), saves them with a
small ``tokenizer.json`` and runs the checks below against what rnnserve loads from that directory.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, models

from rnnserve.engine import LLM, SamplingParams
from rnnserve.engine.config import EngineConfig
from rnnserve.engine.llm_engine import LLMEngine
from rnnserve.engine.loader import load_model
from rnnserve.engine.models.base import DecodeBatch, PrefillBatch
from rnnserve.engine.state_pool import StatePool

PROMPT_LENGTHS = [1, 2, 9, 33, 64, 100, 157, 200, 5, 71]
NEW_TOKENS = 32


def save_hf(reference: torch.nn.Module, path: Path, **save_kwargs: object) -> Path:
    """``save_pretrained`` plus a word-level ``tokenizer.json`` covering the vocabulary."""
    reference.save_pretrained(path, **save_kwargs)
    vocab = {f"w{i}": i for i in range(reference.config.vocab_size)}
    Tokenizer(models.WordLevel(vocab, unk_token="w1")).save(str(path / "tokenizer.json"))
    return path


def prompts(vocab_size: int, lengths: list[int] = PROMPT_LENGTHS, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=g).tolist() for n in lengths]


@torch.inference_mode()
def check_prefill_logits(
    reference: torch.nn.Module, path: Path, atol: float = 1e-4, use_cache: bool = True
) -> None:
    """(a) One packed prefill of every prompt: last-token logits within ``atol`` of ``transformers``."""
    model, _ = load_model(str(path), device="cpu", dtype="float32")
    seqs = prompts(reference.config.vocab_size)
    pool = StatePool(model.state_spec(), len(seqs) + 3)
    slots = [(3 * i + 2) % (len(seqs) + 3) for i in range(len(seqs))]
    ours = model.prefill(PrefillBatch.build(seqs, slots), pool.tensors)
    expected = torch.stack(
        [reference(torch.tensor([s]), use_cache=use_cache).logits[0, -1].float() for s in seqs]
    )
    torch.testing.assert_close(ours, expected, atol=atol, rtol=0)


@torch.inference_mode()
def check_chunked_and_stepwise(path: Path, vocab_size: int, chunk: int = 13) -> None:
    """(c) Whole prefill == chunked prefill == token-by-token decode (logits and final state)."""
    model, _ = load_model(str(path), device="cpu", dtype="float32")
    seqs = prompts(vocab_size, [1, 12, 13, 40, 77])
    slots = [4, 0, 6, 2, 1]
    pools = [StatePool(model.state_spec(), 8) for _ in range(3)]
    whole = model.prefill(PrefillBatch.build(seqs, slots), pools[0].tensors)
    chunked = torch.empty_like(whole)
    stepwise = torch.empty_like(whole)
    for start in range(0, max(map(len, seqs)), chunk):
        active = [i for i, s in enumerate(seqs) if start < len(s)]
        pieces = [seqs[i][start : start + chunk] for i in active]
        batch = PrefillBatch.build(pieces, [slots[i] for i in active], [start] * len(active))
        chunked[active] = model.prefill(batch, pools[1].tensors)
    for t in range(max(map(len, seqs))):
        active = [i for i, s in enumerate(seqs) if t < len(s)]
        batch = DecodeBatch.build([seqs[i][t] for i in active], [slots[i] for i in active], [t] * len(active))
        stepwise[active] = model.decode(batch, pools[2].tensors)
    torch.testing.assert_close(chunked, whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(stepwise, whole, atol=1e-5, rtol=1e-5)
    for name, tensor in pools[0].tensors.items():
        torch.testing.assert_close(pools[1].tensors[name], tensor, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(pools[2].tensors[name], tensor, atol=1e-5, rtol=1e-5)


@torch.inference_mode()
def hf_greedy(
    reference: torch.nn.Module,
    prompt: list[int],
    max_new_tokens: int,
    stop_at_eos: bool,
    use_cache: bool = True,
) -> list[int]:
    """``transformers``' ``generate`` (greedy); with ``stop_at_eos=False`` the eos id is switched off.

    ``use_cache=False`` recomputes the whole sequence per token (for configs whose HF cache is broken).
    """
    kwargs: dict = {"do_sample": False, "max_new_tokens": max_new_tokens, "use_cache": use_cache}
    if not stop_at_eos:
        kwargs.update(eos_token_id=None, pad_token_id=0)
    out = reference.generate(
        torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long), **kwargs
    )
    return out[0, len(prompt) :].tolist()


def check_greedy_generation(
    reference: torch.nn.Module, path: Path, max_num_batched_tokens: int = 2048, use_cache: bool = True
) -> None:
    """(b) 32 greedy tokens per prompt (lengths 1..200) served 8 at a time == ``transformers`` generate."""
    seqs = prompts(reference.config.vocab_size)
    llm = LLM(
        str(path),
        device="cpu",
        dtype="float32",
        max_num_seqs=8,
        max_num_batched_tokens=max_num_batched_tokens,
    )
    outs = llm.generate(seqs, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    ours = [o.outputs[0].token_ids for o in outs]
    theirs = [hf_greedy(reference, s, NEW_TOKENS, stop_at_eos=False, use_cache=use_cache) for s in seqs]
    assert ours == theirs


def check_eos_agrees(reference: torch.nn.Module, path: Path) -> None:
    """Both engines stop at the checkpoint's eos id (taken from generation_config.json), and at each id of a
    list of them (the first of which, here, never comes)."""
    prompt = prompts(reference.config.vocab_size, [7])[0]
    free_run = hf_greedy(reference, prompt, 12, stop_at_eos=False)
    eos = free_run[5]
    absent = next(t for t in range(reference.config.vocab_size) if t not in free_run)
    for configured in (eos, [absent, eos]):
        reference.generation_config.eos_token_id = configured
        reference.generation_config.save_pretrained(path)
        model, tokenizer = load_model(str(path), device="cpu", dtype="float32")
        assert tokenizer.eos_token_ids == ({eos} if configured == eos else {absent, eos})
        engine = LLMEngine(model, tokenizer, EngineConfig(max_num_seqs=2))
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=12))
        final = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                final = out
        assert final is not None
        theirs = hf_greedy(reference, prompt, 12, stop_at_eos=True)
        assert theirs[-1] == eos and len(theirs) <= 6
        assert final.outputs[0].token_ids == theirs
        assert final.outputs[0].finish_reason == "stop"


def run_all(reference: torch.nn.Module, path: Path, use_cache: bool = True) -> None:
    """Checks (a), (c) and (b) for one saved checkpoint."""
    reference.eval()
    check_prefill_logits(reference, path, use_cache=use_cache)
    check_chunked_and_stepwise(path, reference.config.vocab_size)
    check_greedy_generation(reference, path, use_cache=use_cache)
