"""``rnnserve convert --format based``: the Based authors' release directory (GPT-2-style ``config.json`` with the
mixer dicts + ``pytorch_model.bin``, as on hazyresearch/based-360m) -> a native rnnserve directory.

As the authors' loader does, keys lose a leading ``model.`` and training ``metrics`` entries are dropped; the
tied embedding is stored once (as ``lm_head.weight``). The weights are checked against the model the config
describes (names and shapes) before anything is written.
"""

from __future__ import annotations

from pathlib import Path

import torch

from rnnserve.engine.convert import (
    ConvertedCheckpoint,
    ConvertError,
    load_pickled_tensors,
    read_config,
    training_state_dict,
)
from rnnserve.engine.models.based import BasedConfig, BasedLM

WEIGHTS = "pytorch_model.bin"
TIED = ("transformer.embeddings.word_embeddings.weight", "lm_head.weight")


def detect(src: Path) -> bool:
    """A directory with ``pytorch_model.bin`` and a GPT-2-style config naming Based mixers."""
    config = read_config(src) if src.is_dir() else None
    if config is None or not (src / WEIGHTS).is_file() or config.get("model_type") != "gpt2":
        return False
    targets = [str((config.get(key) or {}).get("_target_", "")) for key in ("mixer", "alt_mixer", "alt_mixer_2")]
    return any(t.startswith("based.") for t in targets)


def convert(src: Path) -> ConvertedCheckpoint:
    """Read ``config.json`` and ``pytorch_model.bin`` (tensors only) and map them to the native layout."""
    hf = read_config(src)
    if hf is None:
        raise ConvertError(f"{src}: no readable config.json")
    try:
        config = BasedLM.from_hf_config(hf)
        config.check_types()  # as the loader does: a string window_size would fail building the model
    except (KeyError, TypeError, ValueError) as err:
        raise ConvertError(f"{src / 'config.json'}: not a Based config: {err}") from err
    state, notes = training_state_dict(load_pickled_tensors(src / WEIGHTS), src / WEIGHTS)
    metrics = [k for k in state if "metrics" in k]
    if metrics:
        notes.append(f"dropped {len(metrics)} training metrics entries")
    tensors: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if "metrics" in key:
            continue
        name = BasedLM.hf_weight_name(key)
        if name in tensors:  # "model.x" and "x": one would silently replace the other
            raise ConvertError(f"{src / WEIGHTS}: {key} and another key both name the weight {name}")
        tensors[name] = value
    if config.tie_embeddings and all(k in tensors for k in TIED):
        embedding = tensors.pop(TIED[0])
        if not torch.equal(embedding, tensors[TIED[1]]):
            raise ConvertError(f"{src / WEIGHTS}: tie_word_embeddings is set but {TIED[0]} differs from {TIED[1]}")
        notes.append("tied embedding stored once, as lm_head.weight")
    _check_against_model(config, tensors, src / WEIGHTS)
    tokenizer = src / "tokenizer.json"
    return ConvertedCheckpoint(
        config={"architecture": BasedLM.architecture, **config.to_dict()},
        tensors=tensors,
        tokenizer_json=tokenizer if tokenizer.is_file() else None,
        notes=notes,
    )


def _check_against_model(config: BasedConfig, tensors: dict[str, torch.Tensor], source: Path) -> None:
    """Every parameter present with its shape (a tied one under either name), nothing unexpected."""
    with torch.device("meta"):
        model = BasedLM(config)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    tied_ok = config.tie_embeddings and any(k in tensors for k in TIED)
    missing = sorted(k for k in expected if k not in tensors and not (k in TIED and tied_ok))
    unexpected = sorted(k for k in tensors if k not in expected)
    if missing or unexpected:
        raise ConvertError(f"{source}: missing weights {missing[:5]}, unexpected weights {unexpected[:5]}")
    for key, tensor in tensors.items():
        if tuple(tensor.shape) != expected[key]:
            raise ConvertError(f"{source}: {key} has shape {tuple(tensor.shape)}, the config implies {expected[key]}")
