"""Request limits: length (max_model_len, max_prompt_tokens), max_tokens, stop strings and prompt token ids
the tokenizer cannot decode are a 400 (InvalidParameterError naming the field) before admission."""

from __future__ import annotations

import pytest

from rnnserve.engine.config import DEFAULT_MAX_MODEL_LEN, EngineConfig
from rnnserve.engine.llm_engine import LLMEngine
from rnnserve.engine.sampling_params import InvalidParameterError, SamplingParams
from rnnserve.engine.tokenizer import ByteTokenizer
from tests.engine.conftest import make_engine, run_to_completion, tiny_model
from tests.engine.test_toy_architecture import RunningSumConfig, RunningSumLM


def _rejects(engine: LLMEngine, param: str, prompt: str | list[int], **params: object) -> None:
    with pytest.raises(InvalidParameterError) as err:
        engine.add_request(prompt, SamplingParams(**params))
    assert err.value.param == param
    assert engine.scheduler.num_waiting == 0 and engine.pool.num_used == 0


def test_max_model_len_defaults_to_the_models_limit_else_the_engine_default() -> None:
    assert make_engine().max_model_len == DEFAULT_MAX_MODEL_LEN == 131072
    toy = RunningSumLM(RunningSumConfig(max_len=48))
    assert LLMEngine(toy, ByteTokenizer()).max_model_len == 48
    assert LLMEngine(toy, ByteTokenizer(), EngineConfig(max_model_len=40)).max_model_len == 40
    with pytest.raises(ValueError, match="exceeds the model's limit"):
        LLMEngine(toy, ByteTokenizer(), EngineConfig(max_model_len=49))
    with pytest.raises(ValueError, match="max_prompt_tokens"):
        EngineConfig(max_model_len=64, max_prompt_tokens=65)


def test_prompt_and_prompt_plus_max_tokens_are_bounded() -> None:
    engine = make_engine(max_model_len=64)
    _rejects(engine, "prompt", "x" * 65, max_tokens=1)
    _rejects(engine, "max_tokens", "x" * 60, max_tokens=5)
    engine.add_request("x" * 60, SamplingParams(max_tokens=4))
    tighter = make_engine(max_model_len=64, max_prompt_tokens=16)
    assert tighter.max_prompt_tokens == 16
    _rejects(tighter, "prompt", "x" * 17, max_tokens=1)
    tighter.add_request("x" * 16, SamplingParams(max_tokens=48))


def test_fit_max_tokens_shortens_a_default_to_the_room_the_prompt_leaves() -> None:
    """A server request without max_tokens (``fit_max_tokens``) generates up to the room under max_model_len, as
    vLLM takes a missing max_tokens; a prompt with no room left is a 400 on the prompt; an explicit max_tokens that
    does not fit stays a 400, and the caller's params are not changed."""
    engine = make_engine(max_model_len=64)
    params = SamplingParams(max_tokens=256, min_tokens=10, ignore_eos=True, fit_max_tokens=True)
    request = engine.add_request("x" * 60, params)
    assert params.max_tokens == 256 and params.min_tokens == 10
    out = run_to_completion(engine)[request]
    assert len(out.outputs[0].token_ids) == 4 and out.outputs[0].finish_reason == "length"
    _rejects(engine, "prompt", "x" * 64, max_tokens=256, fit_max_tokens=True)
    _rejects(engine, "max_tokens", "x" * 60, max_tokens=256)


def test_max_tokens_none_generates_up_to_the_room_the_prompt_leaves() -> None:
    """vLLM's ``SamplingParams(max_tokens=None)``: no limit but max_model_len (``fit_max_tokens`` with no bound of
    its own), also where a ``min_tokens`` is given."""
    engine = make_engine(max_model_len=64)
    params = SamplingParams(max_tokens=None, min_tokens=8, ignore_eos=True, temperature=0)
    assert params.fit_max_tokens
    request = engine.add_request("x" * 40, params)
    out = run_to_completion(engine)[request].outputs[0]
    assert len(out.token_ids) == 24 and out.finish_reason == "length"
    _rejects(engine, "prompt", "x" * 64, max_tokens=None)


def test_huge_max_tokens_is_rejected_not_holding_slots() -> None:
    engine = make_engine(max_num_seqs=4)
    _rejects(engine, "max_tokens", "hello", n=4, max_tokens=10**12)


def test_stop_strings_are_limited_in_number_and_length() -> None:
    engine = make_engine(max_stop_sequences=2, max_stop_length=8)
    _rejects(engine, "stop", "hi", stop=["a", "b", "c"])
    _rejects(engine, "stop", "hi", stop=["a" * 9])
    engine.add_request("hi", SamplingParams(stop=["a", "b" * 8]))


def test_default_stop_length_limit() -> None:
    engine = make_engine()
    assert (engine.config.max_stop_sequences, engine.config.max_stop_length) == (16, 512)
    _rejects(engine, "stop", "hi", stop=["a" * 513])


def test_prompt_token_ids_the_tokenizer_cannot_decode_are_rejected() -> None:
    engine = LLMEngine(tiny_model("mingru", vocab_size=320), ByteTokenizer(), EngineConfig(max_num_seqs=2))
    _rejects(engine, "prompt", [72, 105, 300])  # inside the model's padded vocabulary, past the tokenizer's
    _rejects(engine, "prompt", [72, 320])
    _rejects(engine, "prompt", [-1])
    engine.add_request([72, 105, 256], SamplingParams())  # 256 is the tokenizer's EOS: a real token
