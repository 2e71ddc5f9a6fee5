"""Structured outputs and logit bias on CUDA: with async scheduling (its default there) the same tokens as the
synchronous engine, every constrained sample valid, unconstrained rows beside them unchanged."""

from __future__ import annotations

import json
import re

import pytest
import torch

from rnnserve.engine import LLM, SamplingParams
from rnnserve.engine.sampling_params import StructuredOutputParams as Constraint

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
pytest.importorskip("llguidance")  # carried to a GPU image as an optional wheel (make gpu-wheels)

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
          "required": ["ok", "n"], "additionalProperties": False}  # fmt: skip
PARAMS = [
    SamplingParams(temperature=0, max_tokens=40, structured_outputs=Constraint(json=SCHEMA)),
    SamplingParams(temperature=0.9, seed=3, n=2, max_tokens=40, structured_outputs=Constraint(regex="[a-f]{3,6}")),
    SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=12, structured_outputs=Constraint(choice=["alpha", "beta", "gamma"])),
    SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logit_bias={ord("q"): 100.0}),
]


@pytest.mark.parametrize("preset", ["random:mingru-tiny", "random:mamba-tiny"])
def test_constrained_generation_on_cuda_matches_sync_and_follows_the_constraints(preset: str) -> None:
    prompts = [f"request {i}: " * (1 + i % 3) for i in range(15)]
    params = [PARAMS[i % len(PARAMS)] for i in range(len(prompts))]
    options = {"device": "cuda", "dtype": "float32", "max_num_seqs": 12, "max_num_batched_tokens": 64}
    sync = LLM(preset, async_scheduling="off", **options)
    ahead = LLM(preset, **options)
    assert ahead.engine.async_scheduling
    expected, got = sync.generate(prompts, params), ahead.generate(prompts, params)
    assert all(out.error is None for out in got)
    assert [[(s.token_ids, s.finish_reason) for s in o.outputs] for o in got] == [
        [(s.token_ids, s.finish_reason) for s in o.outputs] for o in expected
    ]
    for out, param in zip(got, params, strict=True):
        constraint = param.structured_outputs
        for sample in out.outputs:
            if constraint is not None:
                assert sample.finish_reason == "stop", sample.text
            if constraint is not None and constraint.json is not None:
                assert set(json.loads(sample.text)) == {"ok", "n"}
            elif constraint is not None and constraint.regex is not None:
                assert re.fullmatch(constraint.regex, sample.text)
            elif constraint is not None:
                assert sample.text in (constraint.choice or [])
            elif param.logit_bias:
                assert sample.text == "q" * 8
    assert ahead.engine.pool.num_used == 0 and sync.engine.pool.num_used == 0
