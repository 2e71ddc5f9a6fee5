"""Where the chat template comes from (``--chat-template FILE`` > ``chat_template.jinja`` beside the tokenizer >
``tokenizer_config.json`` > the default) and vLLM's ``chat_template_kwargs``; ``/tokenizer_info`` and
``/tokenize`` on a model with a Hugging Face tokenizer."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from rnnserve.engine.chat_template import model_directory
from rnnserve.engine.loader import DEFAULT_MODEL_DIR
from rnnserve.server.app import ServerConfig, create_app
from tests.server.tiny_checkpoint import EOS, write_tiny_checkpoint

pytestmark = pytest.mark.timeout(60)

CONFIG_TEMPLATE = "{% for m in messages %}[config]{{ m.content }}{% endfor %}"
JINJA_TEMPLATE = "{% for m in messages %}[jinja]{{ m.content }}{% endfor %}"
FILE_TEMPLATE = (
    "{% if greeting %}{{ greeting }} {% endif %}{% for m in messages %}[file]{{ m.content }}{% endfor %}"
    "{% if add_generation_prompt %}>{% endif %}"
)
MESSAGES = [{"role": "user", "content": "Hi"}]


@contextmanager
def serving(model: Path | str, **options: object) -> Iterator[TestClient]:
    config = ServerConfig.build(model=str(model), max_num_seqs=2, api_key=None, **options)
    with TestClient(create_app(config)) as client:
        yield client


def rendered(client: TestClient, **body: object) -> str:
    response = client.post("/tokenize", json={"messages": MESSAGES, **body})
    assert response.status_code == 200, response.text
    return client.post("/detokenize", json={"tokens": response.json()["tokens"]}).json()["prompt"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("hf"), chat_template=CONFIG_TEMPLATE)


@pytest.fixture(scope="module")
def template_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("template") / "chat.jinja"
    path.write_text(FILE_TEMPLATE)
    return path


def test_template_precedence(checkpoint: Path, template_file: Path, tmp_path: Path) -> None:
    with serving(checkpoint) as client:
        assert rendered(client) == "[config]Hi"
        assert client.get("/tokenizer_info").json()["chat_template"] == CONFIG_TEMPLATE
    beside = write_tiny_checkpoint(tmp_path / "beside", chat_template=CONFIG_TEMPLATE)
    (beside / "chat_template.jinja").write_text(JINJA_TEMPLATE)
    with serving(beside) as client:
        assert rendered(client) == "[jinja]Hi"
        assert client.get("/tokenizer_info").json()["chat_template"] == JINJA_TEMPLATE
    with serving(beside, chat_template=str(template_file)) as client:
        assert rendered(client) == "[file]Hi>"


def test_chat_template_kwargs_reach_the_template(template_file: Path) -> None:
    with serving("random:mingru-tiny", chat_template=str(template_file)) as client:
        assert rendered(client, chat_template_kwargs={"greeting": "Hello"}) == "Hello [file]Hi>"
        assert rendered(client, chat_template_kwargs={"add_generation_prompt": False}) == "[file]Hi"
        chat = {"messages": MESSAGES, "max_tokens": 1, "chat_template_kwargs": {"greeting": "Hello"}}
        usage = client.post("/v1/chat/completions", json=chat).json()["usage"]
        assert usage["prompt_tokens"] == len("Hello [file]Hi>")
        response = client.post("/v1/chat/completions", json={**chat, "chat_template_kwargs": {"messages": []}})
        assert response.status_code == 400 and response.json()["error"]["param"] == "chat_template_kwargs"


TOOL_TEMPLATE = (
    "{% for t in tools or [] %}<tool {{ t.function.name }}: {{ t.function.parameters | tojson }}>{% endfor %}"
    "{% for m in messages %}[{{ m.role }}{% if m.tool_call_id %} {{ m.tool_call_id }}{% endif %}]{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<call {{ c.function.name }} {{ c.function.arguments.city }}>{% endfor %}"
    "{% endfor %}"
)


def test_tools_and_earlier_calls_reach_the_template(tmp_path: Path) -> None:
    """``tools`` (chat and /tokenize) and a history with an assistant's ``tool_calls`` (arguments given as JSON
    text reach the template as an object) and the tool's answer with its ``tool_call_id``."""
    template = tmp_path / "tools.jinja"
    template.write_text(TOOL_TEMPLATE)
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    history = [
        {"role": "user", "content": "Weather in Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Rome"}'}}]},  # fmt: skip
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    expected = '<tool get_weather: {"type": "object"}>[user]Weather in Rome?[assistant]<call get_weather Rome>'
    expected += "[tool call_1]sunny"
    with serving("random:mingru-tiny", chat_template=str(template)) as client:
        assert rendered(client, messages=history, tools=[tool]) == expected
        chat = {"messages": history, "tools": [tool], "max_tokens": 1,
                "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}  # fmt: skip
        usage = client.post("/v1/chat/completions", json=chat).json()["usage"]
        assert usage["prompt_tokens"] == len(expected)
        without = client.post("/v1/chat/completions", json={**chat, "tool_choice": "none"}).json()["usage"]
        assert without["prompt_tokens"] == len(expected) - len('<tool get_weather: {"type": "object"}>')


# Llama 3.1's way of writing a call: string concatenation, which Jinja leaves to Python
CONCATENATING_TEMPLATE = (
    "{% for m in messages %}{% for c in m.tool_calls or [] %}{{ '<call>' + c.function.name }}{% endfor %}"
    "{{ m.role + ': ' + m.content }}{% endfor %}"
)


def test_values_a_template_cannot_render_are_400s_not_500s(tmp_path: Path) -> None:
    """A Python error a template meets on the request's values (a tool call's name that is a number, added to a
    string: a ``TypeError``, not a Jinja error) is a 400 naming ``messages``, on chat and /tokenize."""
    template = tmp_path / "concatenating.jinja"
    template.write_text(CONCATENATING_TEMPLATE)
    call = {"id": "call_1", "type": "function", "function": {"name": 5, "arguments": "{}"}}
    history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None, "tool_calls": [call]}]
    with serving("random:mingru-tiny", chat_template=str(template)) as client:
        for path, body in [("/v1/chat/completions", {"messages": history, "max_tokens": 1}),
                           ("/tokenize", {"messages": history})]:  # fmt: skip
            response = client.post(path, json=body)
            assert response.status_code == 400, (path, response.text)
            error = response.json()["error"]
            assert error["param"] == "messages" and "chat template error" in error["message"], error
        assert rendered(client) == "user: Hi"


def test_a_bad_template_file_stops_the_server_at_start(tmp_path: Path) -> None:
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}")
    for path, message in [(broken, "does not compile"), (tmp_path / "missing.jinja", "cannot read")]:
        with pytest.raises(ValueError, match=message):
            create_app(ServerConfig.build(model="random:mingru-tiny", max_num_seqs=1, chat_template=str(path)))


def test_chat_template_flag() -> None:
    parser = argparse.ArgumentParser()
    ServerConfig.add_arguments(parser)
    assert ServerConfig.from_args(parser.parse_args(["--chat-template", "t.jinja"])).chat_template == "t.jinja"
    assert ServerConfig.from_args(parser.parse_args([])).chat_template is None


def test_tokenizer_routes_with_a_hugging_face_tokenizer(tmp_path: Path) -> None:
    path = write_tiny_checkpoint(tmp_path, bos_token=EOS, add_bos_token=True)
    with serving(path) as client:
        info = client.get("/tokenizer_info").json()
        assert info["eos_token"] == info["bos_token"] == EOS and info["eos_token_id"] == info["bos_token_id"]
        eos_id = info["eos_token_id"]
        with_bos = client.post("/tokenize", json={"prompt": "The fox"}).json()["tokens"]
        plain = client.post("/tokenize", json={"prompt": "The fox", "add_special_tokens": False}).json()["tokens"]
        assert with_bos == [eos_id, *plain] and eos_id not in plain
        special = client.post("/tokenize", json={"prompt": EOS, "add_special_tokens": False}).json()["tokens"]
        assert special == [eos_id]  # what lm-eval's remote tokenizer reads as the EOS id


def test_chat_template_jinja_of_a_cached_hugging_face_repo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--org--tiny"
    snapshot = write_tiny_checkpoint(repo / "snapshots" / commit)
    (snapshot / "chat_template.jinja").write_text(JINJA_TEMPLATE)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert model_directory("org/tiny") == snapshot
    assert model_directory("org/absent") is None and model_directory("random:mingru-tiny") is None
    with serving("org/tiny") as client:
        assert rendered(client) == "[jinja]Hi"


def test_a_reply_sent_back_resumes_from_the_state_after_it() -> None:
    """Under the default template a reply sent back as the model generated it renders as the same tokens, so the
    next turn's prefix-cache hit covers the reply too (all but its last token, which the state has not consumed
    yet), not only the previous prompt."""
    with serving(DEFAULT_MODEL_DIR) as client:
        messages = [{"role": "system", "content": "Answer in one line."}, {"role": "user", "content": "Who codes?"}]
        body = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}
        first = client.post("/v1/chat/completions", json={"messages": messages, **body}).json()
        reply, usage = first["choices"][0]["message"]["content"], first["usage"]
        assert usage["completion_tokens"] == len(reply.encode()) == 8  # byte-level: the text is the tokens
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "Why?"}]
        second = client.post("/v1/chat/completions", json={"messages": messages, **body}).json()
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] + 8 - 1


def test_a_template_that_writes_bos_gets_one_bos(tmp_path: Path) -> None:
    """Gemma's setup: ``add_bos_token`` and a template starting with ``{{ bos_token }}``. The rendered text was
    encoded with the automatic BOS in front of the template's: two, where transformers and vLLM have one."""
    from rnnserve import LLM, SamplingParams

    template = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    path = write_tiny_checkpoint(tmp_path, bos_token=EOS, add_bos_token=True, chat_template=template)
    llm = LLM(str(path), max_num_seqs=1)
    [out] = llm.chat([{"role": "user", "content": "The fox"}], SamplingParams(max_tokens=1))
    bos = llm.tokenizer.bos_token_id
    assert out.prompt_token_ids[:2] == [bos, *llm.tokenizer.encode_plain("The fox")[:1]]
    assert llm.tokenizer.encode("The fox")[0] == bos  # text without it still gets the automatic one
    with serving(path) as client:
        chat = {"messages": [{"role": "user", "content": "The fox"}]}
        assert client.post("/tokenize", json=chat).json()["tokens"] == out.prompt_token_ids
