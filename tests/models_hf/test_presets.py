"""Every architecture's tiny ``random:`` preset serves in fp32 and bf16; every registered preset builds and
decodes (the small ones for real on CPU, all of them on the meta device); the paper-size presets exist."""

from __future__ import annotations

import pytest
import torch

from rnnserve.engine import LLM, SamplingParams
from rnnserve.engine.models import MODEL_REGISTRY, PRESETS
from rnnserve.engine.models.base import DecodeBatch

SMALL_PARAMS = 25_000_000  # presets up to this size also build with real weights and generate on CPU

TINY = [
    "mamba-tiny",
    "mamba2-tiny",
    "hawk-tiny",
    "griffin-tiny",
    "rnn-tiny",
    "rnn-relu-tiny",
    "lstm-tiny",
    "gru-tiny",
]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("preset", TINY)
def test_tiny_preset_generates(preset: str, dtype: str) -> None:
    llm = LLM(f"random:{preset}", device="cpu", dtype=dtype, max_num_seqs=4, max_num_batched_tokens=16)
    prompts = [[1, 2, 3], list(range(40)), [7]]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in outs] == [5, 5, 5]
    again = llm.generate(prompts[1], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    if dtype == "float32":  # chunked prefill in another batch composition gives the same greedy tokens
        assert again[0].outputs[0].token_ids == outs[1].outputs[0].token_ids


def test_paper_size_presets_are_registered() -> None:
    for name in [
        "mamba-130m",
        "mamba-370m",
        "mamba-1.4b",
        "mamba2-130m",
        "mamba2-370m",
        "hawk-100m",
        "griffin-100m",
        "recurrentgemma-2b",
        "lstm-medium",
        "gru-large",
    ]:
        assert name in PRESETS


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_preset_builds_and_decodes(preset: str) -> None:
    """Shapes of every preset on the meta device (no memory, no init); small presets generate for real."""
    architecture, overrides = PRESETS[preset]
    cls = MODEL_REGISTRY[architecture]
    with torch.device("meta"):
        model = cls(cls.config_class(**overrides)).to(torch.bfloat16).eval()
    state = {s.name: torch.empty((3, *s.shape), dtype=s.dtype, device="meta") for s in model.state_spec()}
    with torch.inference_mode():
        logits = model.decode(DecodeBatch.build([1, 2], [0, 1], [3, 0], device="meta"), state)
    assert logits.shape == (2, model.vocab_size) and logits.dtype.is_floating_point
    if sum(p.numel() for p in model.parameters()) <= SMALL_PARAMS:
        llm = LLM(f"random:{preset}", device="cpu", dtype="float32", max_num_seqs=1)
        [out] = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
        assert len(out.outputs[0].token_ids) == 2
