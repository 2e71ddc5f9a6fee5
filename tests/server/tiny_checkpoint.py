"""A tiny checkpoint directory with a real Hugging Face tokenizer (byte-level BPE trained here, with an
``<|endoftext|>`` special token), as users serve them: random ``mingru-tiny`` weights, ``tokenizer.json`` and
``tokenizer_config.json``."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from rnnserve.engine.loader import build_random, save_checkpoint

EOS = "<|endoftext|>"
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A recurrent model keeps a state of constant size.",
    "Paris is the capital of France. Rome is the capital of Italy.",
    "Water boils at one hundred degrees.",
] * 4


def write_tiny_checkpoint(path: Path, **tokenizer_config: object) -> Path:
    """Write the checkpoint into ``path``; ``tokenizer_config`` adds keys (``chat_template``, ...)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    model, _ = build_random("mingru-tiny", torch.device("cpu"), None)
    assert tokenizer.get_vocab_size() <= model.vocab_size
    save_checkpoint(model, path)
    tokenizer.save(str(path / "tokenizer.json"))
    config = {"eos_token": EOS, **tokenizer_config}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path
