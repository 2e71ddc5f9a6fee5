"""Mamba-2 checkpoints in Hugging Face format match ``transformers`` token for token."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.models_hf import hf_harness

transformers = pytest.importorskip("transformers")

BASE = {
    "vocab_size": 96,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "expand": 2,
    "state_size": 8,
    "num_heads": 8,
    "head_dim": 8,
    "n_groups": 1,
    "chunk_size": 16,
}
CASES = {
    "mamba2-1-group": {},
    "mamba2-4-groups-tied-bias": {
        "n_groups": 4,
        "tie_word_embeddings": True,
        "use_bias": True,
        "conv_kernel": 3,
    },
    "mamba2-2-groups-wide-heads": {"num_heads": 2, "head_dim": 32, "n_groups": 2, "state_size": 16},
    "mamba2-conv1": {"conv_kernel": 1},  # no conv state: decode once failed writing one
}


def build(overrides: dict) -> torch.nn.Module:
    torch.manual_seed(0)
    model = transformers.Mamba2ForCausalLM(transformers.Mamba2Config(**{**BASE, **overrides})).eval()
    with torch.no_grad():  # HF initialises the gated norm to ones: perturb it
        for block in model.backbone.layers:
            block.mixer.norm.weight.add_(torch.randn_like(block.mixer.norm.weight) * 0.1)
    return model


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_transformers(case: str, tmp_path: Path) -> None:
    reference = build(CASES[case])
    hf_harness.run_all(reference, hf_harness.save_hf(reference, tmp_path))


def test_state_shapes(tmp_path: Path) -> None:
    from rnnserve.engine.loader import load_model

    reference = build(CASES["mamba2-4-groups-tied-bias"])
    model, _ = load_model(str(hf_harness.save_hf(reference, tmp_path)), device="cpu")
    shapes = {s.name: s.shape for s in model.state_spec()}
    assert shapes == {"conv": (2, 64 + 2 * 4 * 8, 2), "ssm": (2, 8, 8, 8)}
