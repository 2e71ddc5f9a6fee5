"""The embedded default model (``engine/default_model/``): shape, size, and that it writes English."""

from __future__ import annotations

import math
import re

import pytest
import torch

from rnnserve.engine import LLM, SamplingParams
from rnnserve.engine.loader import DEFAULT_MODEL_DIR, load_model
from rnnserve.engine.models.base import DecodeBatch, PrefillBatch
from rnnserve.engine.models.minrnn import MinGRULM
from rnnserve.engine.tokenizer import ByteTokenizer

COMMON_WORDS = {"the", "a", "and", "of", "to", "is", "in", "it", "you", "that", "i", "be", "for", "not", "are",
                "with", "as", "on", "he", "we", "they", "have", "his", "this", "but", "all", "your", "was"}
# Plain English written for this test (not taken from the training corpus).
ENGLISH = (
    "A wise man once said that the best time to plant a tree was twenty years ago, and the second best "
    "time is today. If you want to be happy, do not dwell on the past and do not worry about the future. "
    "Nothing is so hard that it cannot be done by a man who is willing to work for it."
)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(str(DEFAULT_MODEL_DIR), device="cpu", max_num_seqs=8)


def test_checkpoint_is_small_byte_level_mingru() -> None:
    files = sorted(p.name for p in DEFAULT_MODEL_DIR.iterdir())
    assert files == ["config.json", "model.safetensors"]
    assert sum(p.stat().st_size for p in DEFAULT_MODEL_DIR.iterdir()) < 10 * 1000 * 1000
    model, tokenizer = load_model(str(DEFAULT_MODEL_DIR), device="cpu")
    assert isinstance(model, MinGRULM) and isinstance(tokenizer, ByteTokenizer)
    assert model.config.vocab_size >= tokenizer.vocab_size
    assert next(model.parameters()).dtype == torch.float32


def _bits_per_byte(model: MinGRULM, text: str) -> float:
    """Next-byte loss over ``text`` via one prefill per prefix length (the serving path)."""
    ids = torch.tensor([256, *text.encode()])
    config = model.config
    state = {
        "conv": torch.zeros(1, config.n_layers, config.d_model, config.conv_kernel - 1),
        "h": torch.zeros(1, config.n_layers, config.d_hidden),
    }
    total = 0.0
    logits = model.prefill(PrefillBatch.build([ids[:1]], [0]), state)
    for t in range(1, ids.numel()):
        total -= torch.log_softmax(logits[0], -1)[ids[t]].item()
        logits = model.decode(DecodeBatch.build([int(ids[t])], [0], [t]), state)
    return total / (ids.numel() - 1) / math.log(2)


def test_predicts_unseen_english_well() -> None:
    model, _ = load_model(str(DEFAULT_MODEL_DIR), device="cpu")
    bpb = _bits_per_byte(model, ENGLISH)
    assert bpb < 3.0, f"{bpb:.2f} bits per byte on plain English (an untrained one scores about 8)"


def test_prefill_and_decode_agree_on_trained_weights() -> None:
    model, _ = load_model(str(DEFAULT_MODEL_DIR), device="cpu")
    ids = torch.tensor(list(ENGLISH.encode()[:120]))
    config = model.config

    def fresh() -> dict[str, torch.Tensor]:
        return {
            "conv": torch.zeros(1, config.n_layers, config.d_model, config.conv_kernel - 1),
            "h": torch.zeros(1, config.n_layers, config.d_hidden),
        }

    whole = model.prefill(PrefillBatch.build([ids], [0]), fresh())
    state = fresh()
    model.prefill(PrefillBatch.build([ids[:50]], [0]), state)
    for t in range(50, ids.numel()):
        stepped = model.decode(DecodeBatch.build([int(ids[t])], [0], [t]), state)
    torch.testing.assert_close(stepped, whole, atol=1e-4, rtol=1e-4)


def _looks_english(text: str) -> tuple[float, set[str]]:
    plain = sum(ch.isalpha() or ch in " \n\t.,;:'\"!?-()" for ch in text) / max(len(text), 1)
    words = set(re.findall(r"[a-z]+", text.lower())) & COMMON_WORDS
    return plain, words


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_completions_read_as_english(llm: LLM, temperature: float) -> None:
    prompts = ["The ", "A man ", "If you ", "Love is "]
    params = SamplingParams(temperature=temperature, max_tokens=150, seed=0, ignore_eos=True)
    texts = [out.outputs[0].text for out in llm.generate(prompts, params)]
    joined = "".join(texts)
    plain, words = _looks_english(joined)
    assert len(joined) >= 400
    assert plain > 0.9, f"only {plain:.0%} letters/space/punctuation: {texts!r}"
    assert len(words) >= 6, f"common English words found: {sorted(words)}; texts: {texts!r}"
