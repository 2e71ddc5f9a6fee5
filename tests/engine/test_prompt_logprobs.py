"""Prompt logprobs come out of prefill: equal to a direct whole-sequence pass and to token-by-token decode,
whatever the chunking and whatever else is in the batch, for every family of architectures."""

from __future__ import annotations

import pytest
import torch

from rnnserve import LLM, SamplingParams
from rnnserve.engine.llm import GenerationError
from rnnserve.engine.models.base import DecodeBatch, PrefillBatch, RecurrentLM
from rnnserve.engine.outputs import RequestOutput
from rnnserve.engine.sampling_params import InvalidParameterError
from rnnserve.engine.sequence import SequenceGroup
from rnnserve.engine.state_pool import StatePool

PRESETS = ["mamba-tiny", "mamba2-tiny", "mingru-tiny", "lstm-tiny", "gru-tiny", "rnn-relu-tiny", "griffin-tiny"]
PROMPTS = [[7], [72, 101, 108, 108, 111, 44, 32, 119, 111], [(i * 37 + 11) % 256 for i in range(23)]]
TOP = 3


def engine_outputs(preset: str, prompts: list[list[int]], budget: int = 2048, **params: int) -> list[RequestOutput]:
    llm = LLM(f"random:{preset}", device="cpu", dtype="float32", max_num_seqs=8, max_num_batched_tokens=budget)
    defaults = {"temperature": 0, "max_tokens": 2, "ignore_eos": True, "prompt_logprobs": TOP}
    return llm.generate(prompts, SamplingParams(**{**defaults, **params}))


def logprobs_of(out: RequestOutput) -> list[float]:
    assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
    entries = out.prompt_logprobs[1:]
    assert [e.token_id for e in entries] == out.prompt_token_ids[1:]  # type: ignore[union-attr]
    return [e.logprob for e in entries]  # type: ignore[union-attr]


@torch.inference_mode()
def direct_logprobs(model: RecurrentLM, prompt: list[int]) -> torch.Tensor:
    """``log p(prompt[t + 1] | prompt[: t + 1])`` from one whole-prompt prefill that returns every row."""
    pool = StatePool(model.state_spec(), 1)
    logits = model.prefill(PrefillBatch.build([prompt], [0], all_logits=[True]), pool.tensors)
    assert logits.shape[0] == len(prompt)
    logp = torch.log_softmax(logits.double(), -1)
    return logp[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]


@torch.inference_mode()
def decoded_logprobs(model: RecurrentLM, prompt: list[int]) -> torch.Tensor:
    """The same from the first token's prefill followed by one decode step per token."""
    pool = StatePool(model.state_spec(), 1)
    rows = [model.prefill(PrefillBatch.build([prompt[:1]], [0]), pool.tensors)[0]]
    for position, token in enumerate(prompt[1:-1], start=1):
        rows.append(model.decode(DecodeBatch.build([token], [0], [position]), pool.tensors)[0])
    logp = torch.log_softmax(torch.stack(rows).double(), -1)
    return logp[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]


@pytest.mark.parametrize("preset", PRESETS)
def test_prompt_logprobs_equal_a_whole_sequence_pass_and_decode(preset: str) -> None:
    llm = LLM(f"random:{preset}", device="cpu", dtype="float32", max_num_seqs=4)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=TOP))
    model = llm.engine.model
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        got = logprobs_of(out)
        assert len(got) == len(prompt) - 1
        if len(prompt) == 1:
            continue
        assert got == pytest.approx(direct_logprobs(model, prompt).tolist(), abs=1e-4)
        assert got == pytest.approx(decoded_logprobs(model, prompt).tolist(), abs=1e-4)
        for entry in out.prompt_logprobs[1:]:  # type: ignore[index]
            top = [lp for _, lp in entry.top]  # type: ignore[union-attr]
            assert len(top) == TOP and top == sorted(top, reverse=True)
            assert entry.rank >= 1 and (entry.rank == 1) == (entry.logprob >= top[0])  # type: ignore[union-attr]


@pytest.mark.parametrize("preset", PRESETS)
def test_chunked_prefill_and_batching_do_not_change_prompt_logprobs(preset: str) -> None:
    whole = engine_outputs(preset, PROMPTS)
    chunked = engine_outputs(preset, PROMPTS, budget=4)
    alone = [engine_outputs(preset, [p], budget=5)[0] for p in PROMPTS]
    for a, b, c in zip(whole, chunked, alone, strict=True):
        assert logprobs_of(b) == pytest.approx(logprobs_of(a), abs=1e-5)
        assert logprobs_of(c) == pytest.approx(logprobs_of(a), abs=1e-5)
        assert a.outputs[0].token_ids == b.outputs[0].token_ids == c.outputs[0].token_ids


def test_only_requests_that_ask_get_prompt_logprobs() -> None:
    llm = LLM("random:mingru-tiny", device="cpu", max_num_seqs=4, max_num_batched_tokens=6)
    asked = SamplingParams(temperature=0, max_tokens=3, n=2, prompt_logprobs=0, ignore_eos=True)
    plain = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    with_logprobs, without = llm.generate([PROMPTS[2], PROMPTS[1]], [asked, plain])
    assert without.prompt_logprobs is None
    assert all(e.top == [] for e in with_logprobs.prompt_logprobs[1:])  # type: ignore[union-attr, index]
    assert with_logprobs.outputs[0].token_ids == with_logprobs.outputs[1].token_ids  # the fork saw the same state
    reference = llm.generate([PROMPTS[2], PROMPTS[1]], plain)
    expected = [with_logprobs.outputs[0].token_ids, without.outputs[0].token_ids]
    assert [o.outputs[0].token_ids for o in reference] == expected
    assert llm.engine.pool.num_used == 0


@pytest.mark.parametrize("value", [-1, 21, 1.5, True])
def test_prompt_logprobs_range_is_checked(value: object) -> None:
    with pytest.raises(InvalidParameterError) as err:
        SamplingParams(prompt_logprobs=value)  # type: ignore[arg-type]
    assert err.value.param == "prompt_logprobs"


def test_a_request_whose_prompt_logprobs_fail_fails_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    llm = LLM("random:mingru-tiny", device="cpu", max_num_seqs=4)
    real = SequenceGroup.record_prompt_logprobs

    def record(group: SequenceGroup, start: int, logits: torch.Tensor) -> None:
        if group.prompt_token_ids == PROMPTS[1]:
            raise RuntimeError("broken row")
        real(group, start, logits)

    monkeypatch.setattr(SequenceGroup, "record_prompt_logprobs", record)
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1, ignore_eos=True)
    with pytest.raises(GenerationError) as failed:
        llm.generate([PROMPTS[1], PROMPTS[2]], params)
    victim, survivor = failed.value.outputs
    assert victim.error == "RuntimeError: broken row" and victim.outputs[0].token_ids == []
    assert survivor.error is None and len(survivor.outputs[0].token_ids) == 2
    assert len(survivor.prompt_logprobs) == len(PROMPTS[2])  # type: ignore[arg-type]
    assert llm.engine.pool.num_used == 0
