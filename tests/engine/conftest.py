"""Shared fixtures for the engine tests: tiny random models built in-process."""

from __future__ import annotations

import pytest
import torch

from rnnserve.engine.config import EngineConfig
from rnnserve.engine.llm_engine import LLMEngine
from rnnserve.engine.models import MODEL_REGISTRY
from rnnserve.engine.models.minrnn import MinRNNConfig
from rnnserve.engine.tokenizer import ByteTokenizer

ARCHITECTURES = ["mingru", "minlstm"]


def tiny_model(architecture: str, seed: int = 0, **overrides: int) -> torch.nn.Module:
    config = MinRNNConfig(**{"d_model": 32, "n_layers": 2, "vocab_size": 300, **overrides})
    model = MODEL_REGISTRY[architecture](config)
    model.init_weights(torch.Generator().manual_seed(seed))
    return model.eval().requires_grad_(False)


def make_engine(architecture: str = "mingru", **config: object) -> LLMEngine:
    defaults: dict = {"max_num_seqs": 16, "max_num_batched_tokens": 512}
    defaults.update(config)
    return LLMEngine(tiny_model(architecture), ByteTokenizer(), EngineConfig(**defaults))


def run_to_completion(engine: LLMEngine, max_steps: int = 10_000) -> dict:
    final = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return final
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    raise AssertionError("engine did not finish")


@pytest.fixture(params=ARCHITECTURES)
def architecture(request: pytest.FixtureRequest) -> str:
    return request.param
