"""Adding an architecture touches no engine file: this module registers one and serves it.

The toy model keeps a running sum of token embeddings per slot and adds a learned per-position bias to its
logits, so its output depends on the state carried between chunks and on the positions the runner passes.
It declares a length limit, which the engine turns into a 400-style error before admission.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import nn

from rnnserve import LLM, SamplingParams
from rnnserve.engine.loader import save_checkpoint
from rnnserve.engine.models.base import (
    MODEL_REGISTRY,
    DecodeBatch,
    ModelConfig,
    PrefillBatch,
    RecurrentLM,
    StateSpec,
    StateTensors,
    register_model,
    register_preset,
)
from rnnserve.engine.sampling_params import InvalidParameterError


@dataclass
class RunningSumConfig(ModelConfig):
    vocab_size: int = 320
    d_model: int = 16
    max_len: int = 48


@register_model
class RunningSumLM(RecurrentLM):
    architecture = "test-running-sum"
    config_class = RunningSumConfig

    def __init__(self, config: RunningSumConfig) -> None:
        super().__init__(config)
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.position_bias = nn.Embedding(config.max_len, config.vocab_size)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)

    @property
    def max_model_len(self) -> int:
        return self.config.max_len

    def state_spec(self) -> list[StateSpec]:
        return [StateSpec("sum", (self.config.d_model,), torch.float32, 0.0)]

    def _logits(self, total: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return (self.head(torch.tanh(total)) + self.position_bias(positions)).float()

    def prefill(self, batch: PrefillBatch, state: StateTensors) -> torch.Tensor:
        """The running sum after every token (the slot's sum plus the chunk's cumulative sum); the sum after
        the last token goes back into the slot, the rows named by ``logit_rows`` get logits."""
        pool = state["sum"]
        per_token = self.embed(batch.input_ids).float()
        totals = torch.cat([
            pool[slot] + part.cumsum(0)
            for slot, part in zip(batch.slot_ids.tolist(), per_token.split(list(batch.lengths)), strict=True)
        ])
        pool[batch.slot_ids] = totals[batch.cu_seqlens[1:] - 1]
        return self._logits(totals[batch.logit_rows], batch.positions[batch.logit_rows])

    def decode(self, batch: DecodeBatch, state: StateTensors) -> torch.Tensor:
        pool = state["sum"]
        pool[batch.slot_ids] += self.embed(batch.input_ids).float()
        return self._logits(pool[batch.slot_ids], batch.positions)


register_preset("test-running-sum-tiny", "test-running-sum", d_model=8)


def reference_prompt_logprobs(model: RunningSumLM, prompt: list[int]) -> list[float]:
    """Each prompt token's logprob given the tokens before it, from the whole-sequence sums."""
    with torch.no_grad():
        totals = model.embed(torch.tensor(prompt)).float().cumsum(0)
        logp = torch.log_softmax(model._logits(totals, torch.arange(len(prompt))), -1)
    return logp[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])].tolist()


def reference_greedy(model: RunningSumLM, prompt: list[int], max_tokens: int) -> list[int]:
    """Token by token, no engine: the sum of every token so far, the position of the newest one."""
    tokens, out = list(prompt), []
    with torch.no_grad():
        for _ in range(max_tokens):
            total = model.embed(torch.tensor(tokens)).float().sum(0, keepdim=True)
            logits = model._logits(total, torch.tensor([len(tokens) - 1]))
            out.append(int(logits.argmax()))
            tokens.append(out[-1])
    return out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = RunningSumLM(RunningSumConfig())
    model.init_weights(torch.Generator().manual_seed(0))
    path = tmp_path_factory.mktemp("toy")
    save_checkpoint(model, path)
    return path


def test_registered_from_a_test_module() -> None:
    assert MODEL_REGISTRY["test-running-sum"] is RunningSumLM
    llm = LLM("random:test-running-sum-tiny", device="cpu", max_num_seqs=2)
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4))[0]
    assert len(out.outputs[0].token_ids) == 4


@pytest.mark.parametrize("budget", [2048, 5, 1])
def test_engine_matches_the_reference_with_and_without_chunked_prefill(checkpoint: Path, budget: int) -> None:
    llm = LLM(str(checkpoint), device="cpu", max_num_seqs=3, max_num_batched_tokens=budget)
    model = llm.engine.model
    prompts = [[5, 6, 7, 8, 9, 10, 11], [42], [100, 3, 3, 200, 7]]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.outputs[0].token_ids == reference_greedy(model, prompt, 12)
    assert llm.engine.pool.num_used == 0


@pytest.mark.parametrize("budget", [2048, 3])
def test_prompt_logprobs_match_the_reference(checkpoint: Path, budget: int) -> None:
    llm = LLM(str(checkpoint), device="cpu", max_num_seqs=2, max_num_batched_tokens=budget)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [100, 3, 3, 200, 7]]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2))
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
        assert [e.token_id for e in out.prompt_logprobs[1:]] == prompt[1:]  # type: ignore[union-attr]
        got = [e.logprob for e in out.prompt_logprobs[1:]]  # type: ignore[union-attr]
        assert got == pytest.approx(reference_prompt_logprobs(llm.engine.model, prompt), abs=1e-5)


def test_length_limit_is_checked_before_admission(checkpoint: Path) -> None:
    llm = LLM(str(checkpoint), device="cpu", max_num_seqs=2)
    with pytest.raises(InvalidParameterError) as err:
        llm.engine.add_request([1] * 40, SamplingParams(max_tokens=9))
    assert err.value.param == "max_tokens"
    with pytest.raises(InvalidParameterError) as err:
        llm.engine.add_request([1] * 49, SamplingParams(max_tokens=1))
    assert err.value.param == "prompt"
    assert not llm.engine.has_unfinished_requests()
    out = llm.generate([[1] * 40], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 8
