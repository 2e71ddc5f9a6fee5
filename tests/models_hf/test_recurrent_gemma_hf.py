"""RecurrentGemma (Griffin and Hawk) checkpoints in Hugging Face format match ``transformers``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.models_hf import hf_harness

transformers = pytest.importorskip("transformers")

BASE = {
    "vocab_size": 96,
    "hidden_size": 32,
    "intermediate_size": 96,
    "num_attention_heads": 4,
    "num_hidden_layers": 3,
    "attention_window_size": 16,
}
CASES = {
    "griffin-mqa-window16": {"num_key_value_heads": 1},
    "griffin-conv3-bias-attention-first": {
        "conv1d_width": 3,
        "attention_bias": True,
        "block_types": ["attention", "recurrent"],
        "attention_window_size": 7,
    },
    "hawk": {"block_types": ["recurrent"], "num_hidden_layers": 2},
    "hawk-conv1": {"block_types": ["recurrent"], "num_hidden_layers": 2, "conv1d_width": 1},
}


def build(overrides: dict) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.RecurrentGemmaConfig(**{**BASE, **overrides})
    model = transformers.RecurrentGemmaForCausalLM(config).eval()
    with torch.no_grad():  # HF initialises the norms to zero and the biases to zero: perturb them
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "bias")):
                p.add_(torch.randn_like(p) * 0.1)
    return model


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_transformers(case: str, tmp_path: Path) -> None:
    reference = build(CASES[case])
    # transformers 5.23 cannot cache a config without attention layers (Hawk): its cache asks attention layers
    # for the sequence length. The reference then recomputes the whole sequence for every new token.
    use_cache = "attention" in reference.config.block_types
    hf_harness.run_all(reference, hf_harness.save_hf(reference, tmp_path), use_cache=use_cache)


def test_state_is_constant_size(tmp_path: Path) -> None:
    from rnnserve.engine.loader import load_model

    reference = build(CASES["griffin-mqa-window16"])
    model, _ = load_model(str(hf_harness.save_hf(reference, tmp_path)), device="cpu")
    shapes = {s.name: s.shape for s in model.state_spec()}
    assert shapes == {
        "conv": (2, 32, 3),
        "rglru": (2, 32),
        "k": (1, 15, 1, 8),  # the 15 keys before the current token: with it, the 16-token window
        "v": (1, 15, 1, 8),
    }


@pytest.mark.parametrize("key", ["rope_parameters", "rope_scaling"])
@pytest.mark.parametrize("type_key", ["rope_type", "type"])
def test_scaled_rope_is_refused_under_either_name(key: str, type_key: str) -> None:
    """transformers 4 wrote RoPE scaling as ``rope_scaling`` (``type`` or ``rope_type``): it was read as plain
    RoPE, the positions of a long-context fine-tune silently wrong. transformers refuses it for this model."""
    from rnnserve.engine.models.recurrent_gemma import RecurrentGemmaLM

    config = {**BASE, "vocab_size": 64, key: {type_key: "linear", "factor": 4.0}}
    with pytest.raises(ValueError, match="rope_type 'linear' is not supported"):
        RecurrentGemmaLM.from_hf_config(config)
    assert RecurrentGemmaLM.from_hf_config({**config, key: {type_key: "default"}}).rope_theta == 10000.0


def test_sliding_window_is_read_as_transformers_reads_it(tmp_path: Path) -> None:
    """``sliding_window`` is the config's alias of ``attention_window_size`` (``attribute_map``): a config.json
    naming the window so was served with the default window of 2048 instead of the trained one."""
    from rnnserve.engine.models.recurrent_gemma import RecurrentGemmaLM

    both = {**BASE, "sliding_window": 7}  # with attention_window_size 16: the alias is set last, and wins
    assert transformers.RecurrentGemmaConfig(**both).attention_window_size == 7
    assert RecurrentGemmaLM.from_hf_config(both).window == 7
    reference = build(CASES["griffin-conv3-bias-attention-first"])
    path = hf_harness.save_hf(reference, tmp_path)
    config = json.loads((path / "config.json").read_text())
    config["sliding_window"] = config.pop("attention_window_size")
    (path / "config.json").write_text(json.dumps(config))
    hf_harness.check_prefill_logits(reference, path)


def test_a_head_dim_other_than_hidden_size_over_heads_is_served_as_transformers_serves_it(tmp_path: Path) -> None:
    """transformers computes ``head_dim = hidden_size / num_attention_heads`` and then sets config.json's keys over
    it: its attention is as wide as config.json's ``head_dim`` says (a config with ``head_dim`` 16 of 32 / 4 was
    refused, as if transformers overwrote it)."""
    reference = build({"head_dim": 16})
    assert reference.model.layers[2].temporal_block.q_proj.weight.shape == (4 * 16, 32)
    hf_harness.check_prefill_logits(reference, hf_harness.save_hf(reference, tmp_path))
