"""The offline API: ``LLM(model).generate(prompts, params)``."""

from __future__ import annotations

import pytest
import torch

from rnnserve.engine import LLM, SamplingParams
from rnnserve.engine.sampling_params import InvalidParameterError


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("random:mingru-tiny", device="cpu", max_num_seqs=4)


def test_generate_accepts_strings_and_token_ids_in_order(llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=6)
    mixed = llm.generate(["first", [102, 105, 114, 115, 116], "third"], params)
    assert [o.prompt for o in mixed] == ["first", None, "third"]
    assert mixed[0].outputs[0].token_ids == mixed[1].outputs[0].token_ids  # same tokens as "first"
    single = llm.generate("first", params)
    assert len(single) == 1 and single[0].outputs[0].token_ids == mixed[0].outputs[0].token_ids
    ids_only = llm.generate([102, 105, 114, 115, 116], params)
    assert ids_only[0].prompt_token_ids == [102, 105, 114, 115, 116]


def test_more_prompts_than_slots(llm: LLM) -> None:
    outs = llm.generate([f"prompt {i}" for i in range(10)], SamplingParams(temperature=0, max_tokens=4))
    assert [len(o.outputs[0].token_ids) for o in outs] == [4] * 10
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outs)


def test_per_prompt_params_and_outputs(llm: LLM) -> None:
    # ignore_eos: a random model samples EOS now and then (p = 0.003 a token), which would end "a" early
    first = SamplingParams(max_tokens=2, logprobs=2, ignore_eos=True)
    outs = llm.generate(["a", "b"], [first, SamplingParams(max_tokens=5, n=2)])
    assert len(outs[0].outputs[0].token_ids) == 2 and len(outs[0].outputs[0].logprobs) == 2
    assert len(outs[1].outputs) == 2
    with pytest.raises(ValueError):
        llm.generate(["a", "b"], [SamplingParams()])


def test_empty_or_out_of_vocab_prompt_is_rejected(llm: LLM) -> None:
    with pytest.raises(InvalidParameterError, match="empty"):
        llm.generate("", SamplingParams())
    with pytest.raises(InvalidParameterError, match="outside the vocabulary"):
        llm.generate([[1, 2, 100000]], SamplingParams())


def test_cpu_never_captures_cuda_graphs(llm: LLM) -> None:
    assert llm.engine.runner.graphs is None


def test_chat_renders_conversations_as_the_server_does(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """vLLM's ``LLM.chat``: the reply equals the server's chat completion for the same conversation (one, or a
    list); a model directory's ``chat_template.jinja`` and a ``chat_template`` argument are used as the server
    uses ``--chat-template``."""
    from fastapi.testclient import TestClient

    from rnnserve.engine.loader import build_random, save_checkpoint
    from rnnserve.server.app import create_app
    from tests.server.conftest import tiny_config

    model, _ = build_random("mingru-tiny", torch.device("cpu"), None)
    save_checkpoint(model, tmp_path / "ckpt")
    (tmp_path / "ckpt" / "chat_template.jinja").write_text(
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}<a>{% endif %}"
    )
    llm = LLM(str(tmp_path / "ckpt"), max_num_seqs=2)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    [reply] = llm.chat(chat, greedy)
    with TestClient(create_app(tiny_config(model=str(tmp_path / "ckpt")))) as client:
        body = {"messages": chat, "temperature": 0, "max_tokens": 6, "ignore_eos": True}
        served = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
    assert reply.outputs[0].text == served
    assert reply.prompt == "<system>Be brief.<user>Hi there<a>"
    other = [{"role": "user", "content": "Bye"}]
    both = llm.chat([chat, other], greedy)
    assert [o.prompt for o in both] == [reply.prompt, "<user>Bye<a>"] and both[0].outputs[0].text == served
    [custom] = llm.chat(other, greedy, chat_template="{{ messages[0]['content'] }}!", add_generation_prompt=False)
    assert custom.prompt == "Bye!"
    tools = [{"type": "function", "function": {"name": "f"}}]
    [with_tools] = llm.chat(other, greedy, chat_template="{{ tools[0]['function']['name'] }}", tools=tools)
    assert with_tools.prompt == "f"


def test_a_refused_prompt_leaves_no_request_of_its_call_running(llm: LLM) -> None:
    """Prompt 2 of 3 was refused after prompts 0 and 1 were queued: they ran on, and the next call waited for
    them (12 s behind one long orphan)."""
    long = SamplingParams(max_tokens=100_000, ignore_eos=True)
    with pytest.raises(InvalidParameterError):
        llm.generate(["a", "b", [10**9]], long)
    assert not llm.engine.has_unfinished_requests() and llm.engine.pool.num_used == 0
    assert llm.generate("c", SamplingParams(max_tokens=2))[0].outputs[0].token_ids


def test_failed_requests_raise_with_every_output(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """A request the engine failed came back as empty text with finish_reason 'error', easy to miss."""
    from rnnserve.engine.llm import GenerationError

    real = llm.engine.model.decode
    calls = iter(range(10**6))

    def failing_once(*args: object) -> object:
        if next(calls) == 1:
            raise RuntimeError("the device fell over")
        return real(*args)

    monkeypatch.setattr(llm.engine.model, "decode", failing_once)
    with pytest.raises(GenerationError, match="the device fell over") as err:
        llm.generate(["a", "b"], SamplingParams(max_tokens=5, ignore_eos=True))
    assert [o.error is not None for o in err.value.outputs] == [True, True]  # one step: both failed
    monkeypatch.undo()
    assert llm.generate("a", SamplingParams(max_tokens=2))[0].error is None


def test_vllm_prompt_dicts_and_clear_type_errors(llm: LLM) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=3)
    by_text, by_ids = llm.generate([{"prompt": "Hi"}, {"prompt_token_ids": [72, 105]}], sampling_params=greedy)
    assert by_text.outputs[0].token_ids == by_ids.outputs[0].token_ids
    assert llm.generate({"prompt": "Hi"}, greedy)[0].outputs[0].token_ids == by_text.outputs[0].token_ids
    for bad in ({"text": "Hi"}, 3.5, [{"prompt": "a", "x": 1}]):
        with pytest.raises(TypeError, match="prompt"):
            llm.generate(bad, greedy)  # type: ignore[arg-type]
    for ids in ([72.5], [True, 3]):  # 72.5 was read as 72, True as 1
        with pytest.raises(InvalidParameterError, match="integers"):
            llm.generate([ids], greedy)
    with pytest.raises(TypeError, match="message"):
        llm.chat("hello", greedy)  # type: ignore[arg-type]
    assert llm.generate([], greedy) == []
    assert SamplingParams(stop=None, stop_token_ids=None).stop == []  # vLLM's None: none


def test_chat_reads_content_parts_as_the_server_does(llm: LLM) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=3)
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]},
             {"role": "assistant", "content": None}]  # fmt: skip
    [with_parts] = llm.chat(parts, greedy, add_generation_prompt=False)
    assert with_parts.prompt == "User: Hello\nAssistant:\n"
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    with pytest.raises(InvalidParameterError, match="type 'text'"):
        llm.chat(image, greedy)


def test_chat_continuing_the_final_message_needs_add_generation_prompt_false(llm: LLM) -> None:
    """With the default ``add_generation_prompt=True``, ``continue_final_message=True`` dropped the generation
    prompt without a word; the server answers a 400 and vLLM raises."""
    greedy = SamplingParams(temperature=0, max_tokens=3)
    begun = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}]
    with pytest.raises(InvalidParameterError, match="add_generation_prompt") as err:
        llm.chat(begun, greedy, continue_final_message=True)
    assert err.value.param == "continue_final_message" and isinstance(err.value, ValueError)
    [continued] = llm.chat(begun, greedy, continue_final_message=True, add_generation_prompt=False)
    assert continued.prompt == "User: Hi\nAssistant:Hel"


def test_logprobs_beyond_the_vocabulary_give_the_whole_vocabulary() -> None:
    """lsrl:majority has 4 tokens: logprobs=5 failed the request ('selected index k out of range')."""
    small = LLM("lsrl:majority", max_num_seqs=1)
    [out] = small.generate("10110", SamplingParams(temperature=0, max_tokens=2, logprobs=5))
    assert out.error is None and all(len(lp.top) == small.engine.model.vocab_size for lp in out.outputs[0].logprobs)


def test_threads_sharing_an_llm_take_turns(llm: LLM) -> None:
    """Two threads stepping one engine took each other's outputs (a KeyError and lost results)."""
    import concurrent.futures

    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(["a", "b", "c", "d"], params)]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda p: llm.generate(p, params)[0].outputs[0].token_ids, ["a", "b", "c", "d"]))
    assert results == alone


def test_engine_options_passed_as_keywords_are_checked_as_the_command_line_checks_them() -> None:
    """``async_scheduling="yes"`` was taken as off, ``max_num_seqs="8"`` failed deep inside."""
    from pathlib import Path

    from rnnserve.engine.config import EngineConfig

    for options, message in (({"async_scheduling": "yes"}, "one of auto, on, off"), ({"device": "tpu"}, "device"),
                             ({"max_num_seqs": "8"}, "must be int"), ({"max_num_seqs": 2.5}, "must be int"),
                             ({"enforce_eager": 1}, "must be bool"), ({"quantize": "int3"}, "int8, int4")):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            EngineConfig(**options)
    config = EngineConfig(model=Path("some/dir"), state_memory="1GiB", prefill_time_share=1, device="cuda:1",
                          dtype=torch.bfloat16)  # fmt: skip
    assert (config.model, config.state_memory, config.prefill_time_share) == ("some/dir", 2**30, 1.0)


def test_finished_requests_leave_no_garbage_cycles(llm: LLM) -> None:
    """A sample pointed at its request and the request at its samples: each finished request waited for a full
    garbage collection, which a server (young threshold raised) almost never ran, and memory grew for minutes."""
    import gc

    for extra in ({}, {"logprobs": 2, "n": 2}, {"stop": ["zz"]}, {"structured_outputs": {"regex": "[a-z]{5}"}}):
        # a first use may leave garbage of its own once (the first grammar compile in the process left 10 objects)
        llm.generate(["hello"], SamplingParams(max_tokens=6, **extra))
        gc.collect()
        llm.generate(["hello"] * 6, SamplingParams(max_tokens=6, **extra))
        assert gc.collect() < 10, extra  # each leaked request was ~10 objects or more
