"""Helpers shared by the prefix-cache and resume-state tests: engines over every architecture whose outputs can
be sent back as prompts, and a runner that admits a batch of requests together."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest
import torch

from rnnserve import LLM, SamplingParams
from rnnserve.engine.llm_engine import LLMEngine
from rnnserve.engine.models.base import StateTensors
from rnnserve.engine.outputs import RequestOutput
from tests.engine.conftest import run_to_completion

# One random preset per architecture, and a compiled LSRL program (its own alphabet, fp64 state).
MODELS = [
    "random:mingru-tiny", "random:minlstm-tiny", "random:mamba-tiny", "random:mamba2-tiny", "random:griffin-tiny",
    "random:based-tiny", "random:lattice-tiny", "random:looped-tiny", "random:tmlt-tiny", "random:rnn-tiny",
    "random:lstm-tiny", "random:gru-tiny", "lsrl:majority",
]  # fmt: skip
Forward = Callable[[Any, StateTensors], torch.Tensor]
GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=1)


def seeded(seed: int, n: int = 1) -> SamplingParams:
    return SamplingParams(temperature=1.0, top_p=0.9, seed=seed, n=n, max_tokens=5, ignore_eos=True)


def make_engine(model: str, cache: bool, device: str = "cpu", **options: int) -> LLMEngine:
    """An fp32 engine (CPU unless ``device``) whose model never samples a token its tokenizer cannot decode (the
    tiny presets pad their vocabulary beyond the tokenizer's), so every output can be part of a later prompt."""
    defaults = {"max_num_seqs": 16, "max_num_batched_tokens": 512, "prefix_cache_interval": 8}
    engine = LLM(model, device=device, dtype="float32", enable_prefix_cache=cache, **{**defaults, **options}).engine
    vocab = engine.model.vocab_size
    banned = torch.tensor([engine.tokenizer.first_undecodable([t]) is not None for t in range(vocab)])
    banned = banned.to(engine.device)  # once: a copy per call would wait for the device
    model_module = engine.model
    prefill, decode = model_module.prefill, model_module.decode

    def masked(forward: Forward) -> Forward:
        def call(batch: Any, state: StateTensors) -> torch.Tensor:
            return forward(batch, state).masked_fill(banned, float("-inf"))

        return call

    model_module.prefill, model_module.decode = masked(prefill), masked(decode)
    if engine.runner.graphs is not None:  # captured at start-up without the mask: again, with it
        engine.runner.graphs.capture()
    return engine


def token_pool(engine: LLMEngine) -> list[int]:
    """Token ids valid as prompt input: known to the tokenizer and not EOS."""
    vocab = engine.model.vocab_size
    return [t for t in range(vocab) if engine.tokenizer.first_undecodable([t]) is None and t != engine.eos_token_id]


def random_tokens(rng: random.Random, engine: LLMEngine, k: int) -> list[int]:
    return rng.choices(token_pool(engine), k=k)


def run(engine: LLMEngine, requests: list[tuple[list[int], SamplingParams]]) -> list[RequestOutput]:
    """Submit every request at once (so they are admitted in the same step) and run them to completion."""
    ids = [engine.add_request(prompt, params) for prompt, params in requests]
    final = run_to_completion(engine)
    return [final[i] for i in ids]


def samples(outputs: list[RequestOutput]) -> list[list[list[int]]]:
    """Every sample's token ids, per request."""
    return [[s.token_ids for s in out.outputs] for out in outputs]


def assert_same_outputs(outputs: list[RequestOutput], reference: list[RequestOutput]) -> None:
    """The same tokens, and the same log-probabilities (where asked for) up to fp32 rounding: a state that is
    slightly wrong may still pick the same tokens, but not with the same probabilities."""
    assert samples(outputs) == samples(reference)
    for out, ref in zip(outputs, reference, strict=True):
        for sample, ref_sample in zip(out.outputs, ref.outputs, strict=True):
            assert sample.cumulative_logprob == pytest.approx(ref_sample.cumulative_logprob, abs=1e-4)


def sharing_waves(
    engine: LLMEngine, rng: random.Random, num_stems: int, num_waves: int
) -> list[list[tuple[list[int], SamplingParams]]]:
    """Waves of five requests whose prompts share and diverge: each a prefix of one of ``num_stems`` random stems
    plus a few tokens of its own; greedy with logprobs and seeded sampling alternate."""
    tokens = token_pool(engine)
    stems = [rng.choices(tokens, k=rng.randint(8, 30)) for _ in range(num_stems)]
    waves = []
    for wave in range(num_waves):
        prompts = []
        for _ in range(5):
            stem = rng.choice(stems)
            prompts.append(stem[: rng.randint(1, len(stem))] + rng.choices(tokens, k=rng.randint(1, 12)))
        params = [GREEDY if i % 2 else seeded(wave * 10 + i) for i in range(len(prompts))]
        waves.append(list(zip(prompts, params, strict=True)))
    return waves


def run_waves(
    engine: LLMEngine, waves: list[list[tuple[list[int], SamplingParams]]], after_step: Callable[[], None]
) -> list[RequestOutput]:
    """Add each wave and run three steps before the next arrives (``after_step`` after each), then run to the
    end; the outputs in the order of the requests."""
    ids: list[str] = []
    final: dict[str, RequestOutput] = {}
    for wave in waves:
        ids += [engine.add_request(prompt, params) for prompt, params in wave]
        for _ in range(3):
            for out in engine.step():
                if out.finished:
                    final[out.request_id] = out
            after_step()
    final.update(run_to_completion(engine))
    return [final[i] for i in ids]
