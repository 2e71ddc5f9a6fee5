"""Fields the server does not know are ignored with a warning in the log (as vLLM does); content it cannot
serve (images) gets a clear 400; a streamed chat opens with the role alone, as OpenAI's does."""

from __future__ import annotations

import logging

import pytest
from fastapi.testclient import TestClient

from tests.server.test_api import events

pytestmark = pytest.mark.timeout(60)

NEWER_OPENAI_FIELDS = {
    "reasoning_effort": "low",
    "prompt_cache_key": "k",
    "safety_identifier": "user-1",
    "modalities": ["text"],
    "verbosity": "low",
}
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0}


def warned_fields(caplog: pytest.LogCaptureFixture) -> str:
    return " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)


def test_unknown_fields_are_ignored_with_a_warning(client: TestClient, caplog: pytest.LogCaptureFixture) -> None:
    plain = client.post("/v1/chat/completions", json=CHAT).json()
    with caplog.at_level(logging.WARNING, logger="rnnserve.server"):
        body = {**CHAT, **NEWER_OPENAI_FIELDS, "stream": True, "stream_options": {"include_usage": True, "x": 1}}
        streamed = client.post("/v1/chat/completions", json=body)
    assert streamed.status_code == 200
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in events(streamed.text)[:-1] if c["choices"])  # type: ignore[index]
    assert text == plain["choices"][0]["message"]["content"]
    warning = warned_fields(caplog)
    assert "/v1/chat/completions" in warning
    assert all(name in warning for name in [*NEWER_OPENAI_FIELDS, "stream_options.x"])
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="rnnserve.server"):
        completion = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "future_field": {"a": 1}})
        tokens = client.post("/tokenize", json={"prompt": "Hi", "return_token_strs": True})
    assert completion.status_code == tokens.status_code == 200
    assert "future_field" in warned_fields(caplog) and "return_token_strs" in warned_fields(caplog)


def test_known_fields_keep_their_types(client: TestClient) -> None:
    response = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": "2", "future_field": 1})
    assert response.status_code == 400 and response.json()["error"]["param"] == "max_tokens"


@pytest.mark.parametrize(
    ("path", "body", "where", "accepted"),
    [
        ("/v1/completions", {"prompt": [1.5]}, "prompt", "a list of token ids"),
        ("/v1/completions", {"prompt": [[1], "a"]}, "prompt", "a list of token-id lists"),
        ("/v1/completions", {"prompt": "x", "stop": [None]}, "stop", "a list of strings"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages.0.content", "content parts"),
        ("/v1/chat/completions", {**CHAT, "tool_choice": 5}, "tool_choice", "'required'"),
    ],
)
def test_a_value_of_no_accepted_form_names_the_forms(client: TestClient, path: str, body: dict, where: str,
                                                     accepted: str) -> None:  # fmt: skip
    """A field that takes several forms names them all for a value of none of them, not the complaint of the
    first form pydantic tried (``invalid value for prompt.str: Input should be a valid string`` for ``[1.5]``)."""
    error = client.post(path, json=body).json()["error"]
    assert error["param"] == where.split(".")[0] and error["code"] == "invalid_type", error
    assert error["message"].startswith(f"invalid value for {where}: expected ") and accepted in error["message"]
    error = client.post("/v1/completions", json={"prompt": "x", "metadata": {"str": 5}}).json()["error"]
    assert error["message"].startswith("invalid value for metadata.str: Input should be"), error  # a key, no form


@pytest.mark.parametrize(
    "part",
    [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
     {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}],
)
def test_non_text_content_parts_get_a_clear_400(client: TestClient, part: dict) -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, part]}]
    for route in ("/v1/chat/completions", "/tokenize"):
        response = client.post(route, json={"messages": messages})
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["param"] == "messages" and repr(part["type"]) in error["message"]
        assert "text only" in error["message"]


def test_text_parts_are_joined(client: TestClient) -> None:
    parts = [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]
    as_parts = client.post("/tokenize", json={"messages": [{"role": "user", "content": parts}]}).json()
    as_text = client.post("/tokenize", json={"messages": [{"role": "user", "content": "Hello"}]}).json()
    assert as_parts["tokens"] == as_text["tokens"]


def test_an_assistant_refusal_part_is_its_text(client: TestClient) -> None:
    """OpenAI's assistant messages may hold ``refusal`` parts (a refusal sent back with the conversation): text the
    template renders, not a 400 saying the models read text only."""
    refused = [{"type": "text", "text": "I "}, {"type": "refusal", "refusal": "can't."}]
    conversation = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": refused}]
    as_parts = client.post("/tokenize", json={"messages": conversation})
    assert as_parts.status_code == 200, as_parts.text
    as_text = [conversation[0], {"role": "assistant", "content": "I can't."}]
    assert as_parts.json()["tokens"] == client.post("/tokenize", json={"messages": as_text}).json()["tokens"]
    assert client.post("/v1/chat/completions", json={**CHAT, "messages": conversation}).status_code == 200
    no_text = [conversation[0], {"role": "assistant", "content": [{"type": "refusal"}]}]
    error = client.post("/tokenize", json={"messages": no_text}).json()["error"]
    assert error["param"] == "messages" and "'refusal' string" in error["message"]


def test_streamed_chat_opens_with_the_role_alone(client: TestClient) -> None:
    chunks = events(client.post("/v1/chat/completions", json={**CHAT, "n": 2, "stream": True}).text)
    opening = [c["choices"][0] for c in chunks[:2]]  # type: ignore[index]
    assert sorted(c["index"] for c in opening) == [0, 1]
    for choice in opening:
        assert choice["delta"] == {"role": "assistant", "content": ""} and choice["finish_reason"] is None
    rest = [choice for c in chunks[2:-1] for choice in c["choices"]]  # type: ignore[index]
    assert rest and all("role" not in c["delta"] for c in rest)
    assert sorted(c["index"] for c in rest if c["finish_reason"]) == [0, 1]


@pytest.mark.parametrize(
    ("path", "field", "value", "inert"),
    [
        ("/v1/completions", "use_beam_search", True, False),
        ("/v1/completions", "truncate_prompt_tokens", 1, None),
        ("/v1/completions", "bad_words", ["a"], []),
        ("/v1/completions", "return_tokens_as_token_ids", True, False),
        ("/v1/completions", "length_penalty", 0.5, 1),
        ("/v1/chat/completions", "use_beam_search", True, None),
        ("/v1/chat/completions", "echo", True, False),
        ("/v1/chat/completions", "chat_template", "{{ messages[0].content }}", None),
        ("/tokenize", "chat_template", "{{ messages[0].content }}", None),
    ],
)
def test_vllm_fields_this_server_does_not_serve_are_400s_unless_inert(
    client: TestClient, path: str, field: str, value: object, inert: object
) -> None:
    """vLLM's beam search, prompt truncation, bad words, token-id logprobs, chat echo and a request's own chat
    template were ignored as unknown fields: the answer changed without a word. Asked for, they are a 400 naming
    the field; their default is taken."""
    body = {"/v1/chat/completions": CHAT, "/tokenize": {"messages": CHAT["messages"]}}.get(
        path, {"prompt": "Hi", "max_tokens": 2}
    )
    refused = client.post(path, json={**body, field: value})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == field, refused.text
    assert client.post(path, json={**body, field: inert}).status_code == 200
