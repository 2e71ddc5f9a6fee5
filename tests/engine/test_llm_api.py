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
