"""Every architecture's tiny ``random:`` preset serves in fp32 and bf16; the paper-size presets exist."""

from __future__ import annotations

import pytest

from rnnserve.engine import LLM, SamplingParams
from rnnserve.engine.models import PRESETS

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
