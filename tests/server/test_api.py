"""Every endpoint, streaming and not, in-process over random:mingru-tiny."""

from __future__ import annotations

import json
import re

import pytest
from fastapi.testclient import TestClient

from rnnserve.engine.chat_template import DEFAULT_CHAT_TEMPLATE, render_chat
from rnnserve.engine.tokenizer import ByteTokenizer
from rnnserve.server.app import create_app
from tests.server.conftest import TINY, tiny_config

pytestmark = pytest.mark.timeout(60)

GREEDY = {"temperature": 0, "max_tokens": 6}


def events(body: str) -> list[dict | str]:
    """Parse an SSE body into JSON events, keeping the final ``[DONE]`` marker as a string."""
    out: list[dict | str] = []
    for line in body.splitlines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def complete(client: TestClient, **body: object) -> dict:
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def test_completion_non_streaming(client: TestClient) -> None:
    body = complete(client, prompt="Hello", **GREEDY)
    assert body["object"] == "text_completion" and body["model"] == TINY
    [choice] = body["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] == "length" and choice["logprobs"] is None
    assert 0 <= body["usage"].pop("prompt_tokens_details")["cached_tokens"] < 5  # the last one is always prefilled
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 6, "total_tokens": 11}


def test_response_ids_are_distinct_and_random(client: TestClient) -> None:
    body = {"prompt": "Hi", "max_tokens": 1}
    ids = {client.post("/v1/completions", json=body).json()["id"] for _ in range(5)}
    chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                      "max_tokens": 1}).json()["id"]  # fmt: skip
    assert len(ids) == 5 and all(re.fullmatch(r"cmpl-[0-9a-f]{32}", i) for i in ids), ids
    assert re.fullmatch(r"chatcmpl-[0-9a-f]{32}", chat), chat


def test_completion_streaming_matches_non_streaming(client: TestClient) -> None:
    full = complete(client, prompt="Hello", **GREEDY)["choices"][0]["text"]
    response = client.post(
        "/v1/completions",
        json={"prompt": "Hello", "stream": True, **GREEDY, "stream_options": {"include_usage": True}},
    )
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    chunks = events(response.text)
    assert chunks[-1] == "[DONE]"
    *deltas, usage_chunk, _ = chunks
    assert all(c["object"] == "text_completion" and c["usage"] is None for c in deltas)  # type: ignore[index]
    assert "".join(c["choices"][0]["text"] for c in deltas) == full  # type: ignore[index]
    assert deltas[-1]["choices"][0]["finish_reason"] == "length"  # type: ignore[index]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 6  # type: ignore[index]


def test_continuous_usage_stats_reports_usage_on_every_chunk(client: TestClient) -> None:
    options = {"include_usage": True, "continuous_usage_stats": True}
    body = {"prompt": "Hello", "stream": True, "stream_options": options, **GREEDY, "ignore_eos": True}
    chunks = events(client.post("/v1/completions", json=body).text)[:-1]
    completion_tokens = [c["usage"]["completion_tokens"] for c in chunks]  # type: ignore[index]
    assert completion_tokens == sorted(completion_tokens) and completion_tokens[-1] == 6
    assert all(c["usage"]["prompt_tokens"] == 5 for c in chunks)  # type: ignore[index]


def test_continuous_usage_of_a_chat_counts_the_prompt_from_the_opening_chunks(client: TestClient) -> None:
    """The chunks that open each choice with the role carry the prompt's tokens and no completion tokens yet (they
    said 0 prompt tokens), and every chunk after them the running totals of both choices."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    body = {"messages": [{"role": "user", "content": "Hello"}], "n": 2, "stream": True, "stream_options": options,
            **GREEDY, "ignore_eos": True}  # fmt: skip
    chunks = events(client.post("/v1/chat/completions", json=body).text)[:-1]
    final = chunks[-1]["usage"]  # type: ignore[index]
    assert final["completion_tokens"] == 2 * 6 and final["prompt_tokens"] > 0
    opening = [c for c in chunks if c["choices"] and "role" in c["choices"][0]["delta"]]  # type: ignore[index]
    assert [c["choices"][0]["index"] for c in opening] == [0, 1] and chunks[:2] == opening  # type: ignore[index]
    assert all(c["usage"]["prompt_tokens"] == final["prompt_tokens"] for c in chunks)  # type: ignore[index]
    assert [c["usage"]["completion_tokens"] for c in opening] == [0, 0]  # type: ignore[index]
    totals = [c["usage"]["total_tokens"] for c in chunks]  # type: ignore[index]
    assert totals == sorted(totals) and totals[-1] == final["prompt_tokens"] + 2 * 6


def test_stream_without_usage_has_no_usage_field(client: TestClient) -> None:
    chunks = events(client.post("/v1/completions", json={"prompt": "Hi", "stream": True, **GREEDY}).text)
    assert chunks[-1] == "[DONE]" and all("usage" not in c for c in chunks[:-1])


def test_prompt_forms_and_choice_indexes(client: TestClient) -> None:
    text = complete(client, prompt="Hello", **GREEDY)["choices"][0]["text"]
    ids = list(b"Hello")
    assert complete(client, prompt=ids, **GREEDY)["choices"][0]["text"] == text
    body = complete(client, prompt=[ids, list(b"Hi")], n=2, **GREEDY)
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert body["choices"][0]["text"] == body["choices"][1]["text"] == text
    assert body["usage"]["prompt_tokens"] == 5 + 2 and body["usage"]["completion_tokens"] == 4 * 6
    body = complete(client, prompt=["Hello", "Hi"], **GREEDY)
    assert body["choices"][0]["text"] == text and len(body["choices"]) == 2


def test_streaming_several_prompts_interleaves_all_choices(client: TestClient) -> None:
    response = client.post("/v1/completions", json={"prompt": ["Hello", "Hi"], "n": 2, "stream": True, **GREEDY})
    chunks = [c for c in events(response.text) if c != "[DONE]"]
    texts: dict[int, str] = {}
    finished = set()
    for chunk in chunks:
        for choice in chunk["choices"]:  # type: ignore[index]
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
            if choice["finish_reason"]:
                finished.add(choice["index"])
    assert finished == {0, 1, 2, 3}
    assert texts[0] == complete(client, prompt="Hello", **GREEDY)["choices"][0]["text"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("logprobs", [False, True])
def test_a_streamed_choice_ends_once_while_its_siblings_go_on(client: TestClient, path: str, logprobs: bool) -> None:
    """With ``n > 1`` samples that end at different steps, each choice's ``finish_reason`` comes in one chunk and
    nothing more of that choice follows it (as in OpenAI's and vLLM's streams), through the whole server."""
    completions = path == "/v1/completions"
    body = {"prompt": "Hello"} if completions else {"messages": [{"role": "user", "content": "Hi"}]}
    if logprobs:
        body["logprobs"] = 1 if completions else True
    body |= {"n": 4, "temperature": 1.0, "seed": 5, "max_tokens": 48, "stop": list("aeiou stnrl"), "stream": True}
    response = client.post(path, json=body)
    assert response.status_code == 200, response.text
    ends: dict[int, int] = {}  # choice index -> the chunk that ended it
    for number, chunk in enumerate(c for c in events(response.text) if c != "[DONE]"):
        for choice in chunk["choices"]:  # type: ignore[index]
            assert choice["index"] not in ends, f"choice {choice['index']} went on after it ended: {choice}"
            if choice["finish_reason"] is not None:
                ends[choice["index"]] = number
    # Whether the ends come in different chunks depends on the consumer's pace (a loaded machine's merges the steps'
    # outputs): test_stream_batching scripts the steps to check a sibling that goes on.
    assert sorted(ends) == [0, 1, 2, 3]


def test_streamed_usage_of_several_prompts_and_samples_equals_the_response_usage(client: TestClient) -> None:
    body = {"prompt": ["Hello", "Hi"], "n": 2, "temperature": 1.0, "seed": 3, "max_tokens": 5, "stop": ["e"]}
    expected = complete(client, **body)["usage"]
    stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
    *chunks, usage_chunk, done = events(client.post("/v1/completions", json=stream).text)
    assert done == "[DONE]" and all(c["usage"] is None for c in chunks)  # type: ignore[index]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == expected  # type: ignore[index]


def test_seed_makes_sampling_reproducible(client: TestClient) -> None:
    params = {"prompt": "abc", "temperature": 1.0, "max_tokens": 12, "seed": 7}
    assert complete(client, **params)["choices"][0]["text"] == complete(client, **params)["choices"][0]["text"]


def test_stop_string_truncates_and_reports_stop(client: TestClient) -> None:
    text = complete(client, prompt="Hello", temperature=0, max_tokens=12, ignore_eos=True)["choices"][0]["text"]
    stop = text[2:4]
    choice = complete(client, prompt="Hello", temperature=0, max_tokens=12, ignore_eos=True, stop=[stop])["choices"][0]
    assert choice["text"] == text[: text.find(stop)] and choice["finish_reason"] == "stop"


def test_logit_bias_and_allowed_token_ids(client: TestClient) -> None:
    """OpenAI's ``logit_bias`` (token ids as JSON string keys) and vLLM's ``allowed_token_ids``, in completions
    and chat, streamed and not."""
    forced = ord("q")
    body = complete(client, prompt="Hello", **GREEDY, logit_bias={str(forced): 100})
    assert body["choices"][0]["text"] == "q" * 6
    body = complete(client, prompt="Hello", **GREEDY, logit_bias={str(forced): 1e9, "120": -1e9})  # clamped (vLLM)
    assert body["choices"][0]["text"] == "q" * 6
    chat = {"messages": [{"role": "user", "content": "Hi"}], **GREEDY, "stream": True}
    response = client.post("/v1/chat/completions", json={**chat, "logit_bias": {str(forced): 100, "120": -100}})
    assert response.status_code == 200, response.text
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events(response.text)[:-1] if e["choices"])
    assert text == "q" * 6
    allowed = [ord(c) for c in "xyz"]
    body = complete(client, prompt="Hello", temperature=1.0, seed=2, max_tokens=20, allowed_token_ids=allowed)
    assert set(body["choices"][0]["text"]) <= set("xyz") and len(body["choices"][0]["text"]) == 20


def test_logprobs_of_ruled_out_tokens_are_finite_json(client: TestClient) -> None:
    """Alternatives a constraint rules out have logprob -inf in the engine; the responses write them as -9999.0
    (as vLLM and OpenAI do), streamed and not, since JSON has no infinity: a 500 before, and ``-Infinity``,
    which strict JSON parsers reject, in streams."""
    def no_constants(name: str) -> None:
        raise AssertionError(f"{name} in a response")

    completion = {"prompt": "Hi", "max_tokens": 2, "allowed_token_ids": [65], "logprobs": 2, "echo": False}
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "logprobs": True, "top_logprobs": 3,
            "response_format": {"type": "json_object"}}  # fmt: skip
    for path, body in (("/v1/completions", completion), ("/v1/chat/completions", chat)):
        for stream in (False, True):
            response = client.post(path, json={**body, "stream": stream})
            assert response.status_code == 200, response.text
            text = response.text
            for payload in [line[6:] for line in text.splitlines() if line.startswith("data: {")] if stream else [text]:
                json.loads(payload, parse_constant=no_constants)
            assert "-9999.0" in text, text


def test_structured_outputs(client: TestClient) -> None:
    """OpenAI's ``response_format`` (``json_schema``, ``json_object``) in chat and vLLM's ``structured_outputs``
    in completions, streamed and not: the text follows the constraint and the choice ends with ``stop``."""
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "score": {"type": "integer",
              "minimum": 0, "maximum": 9}}, "required": ["answer", "score"], "additionalProperties": False}  # fmt: skip
    chat = {"messages": [{"role": "user", "content": "Hi"}], "temperature": 1.0, "seed": 4, "max_tokens": 100}
    response_format = {"type": "json_schema", "json_schema": {"name": "reply", "schema": schema, "strict": True}}
    for stream in (False, True):
        response = client.post("/v1/chat/completions", json={**chat, "response_format": response_format,
                                                              "stream": stream})  # fmt: skip
        assert response.status_code == 200, response.text
        if stream:
            chunks = [e for e in events(response.text)[:-1] if e["choices"]]
            text = "".join(e["choices"][0]["delta"].get("content", "") for e in chunks)
            reason = chunks[-1]["choices"][0]["finish_reason"]
        else:
            choice = response.json()["choices"][0]
            text, reason = choice["message"]["content"], choice["finish_reason"]
        reply = json.loads(text)
        assert reason == "stop" and set(reply) == {"answer", "score"} and reply["answer"] in ("yes", "no")
        assert 0 <= reply["score"] <= 9
    body = complete(client, prompt="Hello", temperature=1.0, seed=1, max_tokens=300,
                    response_format={"type": "json_object"})  # fmt: skip
    assert body["choices"][0]["text"].startswith("{")
    choices = ["red", "green", "blue"]
    for seed in range(3):
        body = complete(client, prompt="Hello", temperature=1.0, seed=seed, structured_outputs={"choice": choices})
        assert body["choices"][0]["text"] in choices and body["choices"][0]["finish_reason"] == "stop"
    body = complete(client, prompt="Hello", temperature=1.0, n=3, seed=2, max_tokens=30,
                    structured_outputs={"regex": "[0-9]{2}:[0-9]{2}"})  # fmt: skip
    assert all(re.fullmatch("[0-9]{2}:[0-9]{2}", c["text"]) for c in body["choices"])


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer", "minimum": 1,
    "maximum": 7}}, "required": ["city", "days"], "additionalProperties": False}}}  # fmt: skip
CLOCK = {"type": "function", "function": {"name": "get_time"}}


def valid_weather(arguments: str) -> bool:
    parsed = json.loads(arguments)
    return parsed["city"] in ("Paris", "Rome") and 1 <= parsed["days"] <= 7 and set(parsed) == {"city", "days"}


def streamed_tool_calls(chunks: list[dict]) -> tuple[list[dict], str]:
    """The calls a stream's deltas add up to (arguments concatenated per call index) and its finish reason."""
    calls: dict[int, dict] = {}
    for chunk in chunks:
        for piece in chunk["choices"][0]["delta"].get("tool_calls", []):
            call = calls.setdefault(piece["index"], {"id": None, "name": None, "arguments": ""})
            call["id"] = piece.get("id", call["id"])
            call["name"] = piece.get("function", {}).get("name", call["name"])
            call["arguments"] += piece.get("function", {}).get("arguments", "")
    return [calls[i] for i in sorted(calls)], chunks[-1]["choices"][0]["finish_reason"]


def test_forced_tool_calls(client: TestClient) -> None:
    """``tool_choice`` naming a function: the message's one call has arguments that follow its schema (streamed
    as they grow, the id and name first); ``required``: a list of calls of the given tools (one with
    ``parallel_tool_calls: false``), ``finish_reason: "tool_calls"``."""
    chat = {"messages": [{"role": "user", "content": "Weather?"}], "temperature": 1.0, "max_tokens": 80,
            "tools": [WEATHER, CLOCK]}  # fmt: skip
    named = {**chat, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    for seed in range(3):
        body = client.post("/v1/chat/completions", json={**named, "seed": seed}).json()
        choice = body["choices"][0]
        [call] = choice["message"]["tool_calls"]
        assert choice["message"]["content"] is None and choice["finish_reason"] == "stop"
        assert call["type"] == "function" and call["function"]["name"] == "get_weather"
        assert call["id"].startswith("call_")
        assert valid_weather(call["function"]["arguments"])
        response = client.post("/v1/chat/completions", json={**named, "seed": seed, "stream": True})
        chunks = [e for e in events(response.text)[:-1] if e["choices"]][1:]  # after the role chunk
        calls, reason = streamed_tool_calls(chunks)
        assert reason == "stop" and len(calls) == 1 and calls[0]["name"] == "get_weather" and calls[0]["id"]
        assert calls[0]["arguments"] == call["function"]["arguments"]
        assert "id" in chunks[0]["choices"][0]["delta"]["tool_calls"][0]
    required = {**chat, "tool_choice": "required", "parallel_tool_calls": False}
    names = set()
    for seed in range(4):
        body = client.post("/v1/chat/completions", json={**required, "seed": seed}).json()
        choice = body["choices"][0]
        [call] = choice["message"]["tool_calls"]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
        names.add(call["function"]["name"])
        if call["function"]["name"] == "get_weather":
            assert valid_weather(call["function"]["arguments"])
        else:
            assert json.loads(call["function"]["arguments"]) == {}
        response = client.post("/v1/chat/completions", json={**required, "seed": seed, "stream": True})
        calls, reason = streamed_tool_calls([e for e in events(response.text)[:-1] if e["choices"]])
        assert reason == "tool_calls" and [(c["name"], c["arguments"]) for c in calls] == [
            (call["function"]["name"], call["function"]["arguments"])
        ]
    assert names <= {"get_weather", "get_time"}
    cut = client.post("/v1/chat/completions", json={**named, "seed": 0, "max_tokens": 3}).json()["choices"][0]
    assert cut["finish_reason"] == "length" and len(cut["message"]["tool_calls"][0]["function"]["arguments"]) <= 3
    plain = client.post("/v1/chat/completions", json={**chat, "tool_choice": "none", "max_tokens": 5}).json()
    assert "tool_calls" not in plain["choices"][0]["message"] and plain["choices"][0]["message"]["content"] is not None


def test_vllm_extras_are_accepted(client: TestClient) -> None:
    first = complete(client, prompt="Hello", temperature=0, max_tokens=1)["choices"][0]["text"]
    body = complete(client, prompt="Hello", temperature=0, max_tokens=8, stop_token_ids=[ord(first)])
    assert body["choices"][0]["finish_reason"] == "stop" and body["usage"]["completion_tokens"] == 1
    body = complete(
        client,
        prompt="Hello",
        max_tokens=5,
        top_k=5,
        min_p=0.01,
        repetition_penalty=1.2,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        top_p=0.9,
        min_tokens=5,
        ignore_eos=True,
        seed=1,
    )
    assert body["usage"]["completion_tokens"] == 5


def test_completion_logprobs(client: TestClient) -> None:
    choice = complete(client, prompt="Hello", logprobs=2, **GREEDY)["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 6
    assert all(len(top) <= 2 for top in lp["top_logprobs"]) and all(x <= 0 for x in lp["token_logprobs"])
    assert lp["text_offset"][0] == 0
    streamed = events(
        client.post("/v1/completions", json={"prompt": "Hello", "logprobs": 1, "stream": True, **GREEDY}).text
    )
    streamed_lps = [t for c in streamed[:-1] for t in c["choices"][0]["logprobs"]["token_logprobs"]]  # type: ignore[index]
    assert streamed_lps == pytest.approx(lp["token_logprobs"], abs=1e-5)


def test_echo_prepends_the_prompt(client: TestClient) -> None:
    text = complete(client, prompt="Hello", **GREEDY)["choices"][0]["text"]
    assert complete(client, prompt="Hello", echo=True, **GREEDY)["choices"][0]["text"] == "Hello" + text
    chunks = events(
        client.post("/v1/completions", json={"prompt": "Hello", "echo": True, "stream": True, **GREEDY}).text
    )
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == "Hello" + text  # type: ignore[index]


def test_chat_non_streaming_and_streaming(client: TestClient) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    response = client.post("/v1/chat/completions", json={"messages": messages, **GREEDY})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "chat.completion"
    [choice] = body["choices"]
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] == "length"
    prompt = render_chat(ByteTokenizer(), messages)
    assert body["usage"]["prompt_tokens"] == len(prompt.encode())
    chunks = events(
        client.post(
            "/v1/chat/completions",
            json={"messages": messages, "stream": True, **GREEDY, "stream_options": {"include_usage": True}},
        ).text
    )
    assert chunks[-1] == "[DONE]"
    deltas = [c for c in chunks[:-1] if c["choices"]]  # type: ignore[index]
    assert all(c["object"] == "chat.completion.chunk" for c in deltas)  # type: ignore[index]
    assert deltas[0]["choices"][0]["delta"]["role"] == "assistant"  # type: ignore[index]
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in deltas)  # type: ignore[index]
    assert content == choice["message"]["content"]
    assert chunks[-2]["usage"] == body["usage"]  # type: ignore[index]


def test_chat_max_completion_tokens_logprobs_and_content_parts(client: TestClient) -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}]
    body = client.post(
        "/v1/chat/completions",
        json={
            "messages": messages,
            "max_completion_tokens": 3,
            "temperature": 0,
            "logprobs": True,
            "top_logprobs": 2,
        },
    ).json()
    assert body["usage"]["completion_tokens"] == 3
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == 3 and all(len(c["top_logprobs"]) == 2 and "bytes" in c for c in content)
    plain = [{"role": "user", "content": "Hi there"}]
    same = client.post("/v1/chat/completions", json={"messages": plain, "max_tokens": 3, "temperature": 0}).json()
    assert same["choices"][0]["message"]["content"] == body["choices"][0]["message"]["content"]


def test_include_stop_str_in_output(client: TestClient) -> None:
    """vLLM's extra: the stop string that ends the text stays in it (without it, the text stops before it)."""
    body = {"prompt": "Hello", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    text = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    stop = text[5:7]
    assert len(stop) == 2 and text.find(stop) >= 0
    cut = client.post("/v1/completions", json={**body, "stop": [stop]}).json()["choices"][0]
    kept = client.post("/v1/completions", json={**body, "stop": [stop], "include_stop_str_in_output": True})
    assert cut["text"] == text[: text.find(stop)]
    assert kept.json()["choices"][0]["text"] == text[: text.find(stop) + 2]
    assert kept.json()["choices"][0]["finish_reason"] == cut["finish_reason"] == "stop"


def test_a_missing_max_tokens_takes_the_room_the_prompt_leaves() -> None:
    """Without max_tokens a chat (default --chat-max-tokens 256) or a completion (``"max_tokens": null``) on a
    model limited to 40 tokens generates up to the limit instead of a 400 blaming a max_tokens nobody sent; an
    explicit max_tokens that does not fit stays a 400."""
    messages = [{"role": "user", "content": "Hi there"}]
    with TestClient(create_app(tiny_config(max_model_len=40, max_prompt_tokens=40))) as small:
        chat = small.post("/v1/chat/completions", json={"messages": messages, "ignore_eos": True})
        assert chat.status_code == 200, chat.text
        usage = chat.json()["usage"]
        assert usage["prompt_tokens"] + usage["completion_tokens"] == 40
        assert chat.json()["choices"][0]["finish_reason"] == "length"
        completion = small.post("/v1/completions", json={"prompt": "x" * 30, "max_tokens": None, "ignore_eos": True})
        assert completion.status_code == 200
        assert completion.json()["usage"]["prompt_tokens"] + completion.json()["usage"]["completion_tokens"] == 40
        explicit = small.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 100})
        assert explicit.status_code == 400 and explicit.json()["error"]["param"] == "max_tokens"
        full = small.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x" * 60}]})
        assert full.status_code == 400 and full.json()["error"]["param"] in ("prompt", "messages")


def test_default_and_tokenizer_chat_templates() -> None:
    messages = [{"role": "user", "content": "Hi"}]
    assert render_chat(ByteTokenizer(), messages) == "User: Hi\nAssistant:"
    assert render_chat(ByteTokenizer(), messages, add_generation_prompt=False) == "User: Hi\n"
    for reply in ("\n\tYes.", " Yes.", "Yes."):  # sent back as generated: the same text after the prompt
        sent_back = [*messages, {"role": "assistant", "content": reply}, {"role": "user", "content": "Q"}]
        assert render_chat(ByteTokenizer(), sent_back) == f"User: Hi\nAssistant:{reply}\nUser: Q\nAssistant:"
    tokenizer = ByteTokenizer()
    tokenizer.chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    assert render_chat(tokenizer, messages) == "<user>Hi"
    assert DEFAULT_CHAT_TEMPLATE != tokenizer.chat_template


def test_models_tokenize_detokenize_health(client: TestClient) -> None:
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [TINY]
    card = client.get(f"/v1/models/{TINY}").json()
    assert card["id"] == TINY and card == models["data"][0]
    max_model_len = client.app.state.engine.engine.max_model_len
    assert card["max_model_len"] == max_model_len and card["parent"] is None  # vLLM's fields
    tokens = client.post("/tokenize", json={"prompt": "héllo"}).json()
    assert tokens["tokens"] == list("héllo".encode()) and tokens["count"] == 6
    assert tokens["max_model_len"] == client.app.state.engine.engine.max_model_len > 0
    assert client.post("/detokenize", json={"tokens": tokens["tokens"]}).json() == {"prompt": "héllo"}
    chat = client.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert chat["tokens"] == list(b"User: Hi\nAssistant:")
    assert client.get("/health").json() == {"status": "ok"}


def test_generation_routes_are_in_the_schema_and_refuse_other_methods(client: TestClient) -> None:
    paths = client.get("/openapi.json").json()["paths"]
    assert list(paths["/v1/completions"]) == ["post"] and list(paths["/v1/chat/completions"]) == ["post"]
    for path in ("/v1/completions", "/v1/chat/completions"):
        response = client.get(path)
        assert response.status_code == 405 and response.headers["allow"] == "POST", response.text
        assert response.json()["error"]["code"] == "method_not_allowed"


def test_a_405_names_every_method_of_the_path(client: TestClient) -> None:
    """A 405 had ``code: null`` and an ``Allow`` of the first route of the path alone: ``GET`` for a session,
    which takes ``DELETE`` too, and never ``HEAD``, which every GET route answers."""
    session = "/v1/sessions/sess-" + "A" * 24
    for method, path, allow in (
        ("PUT", "/v1/models", "GET, HEAD"),
        ("POST", "/health", "GET, HEAD"),
        ("POST", session, "DELETE, GET, HEAD"),
        ("POST", session + "/state", "GET, HEAD, PUT"),
        ("GET", session + "/fork", "POST"),
        ("DELETE", "/v1/chat/completions", "POST"),
    ):
        response = client.request(method, path, json={} if method in ("POST", "PUT") else None)
        assert response.status_code == 405 and response.headers["allow"] == allow, (method, path, response.text)
        error = response.json()["error"]
        assert error["code"] == "method_not_allowed" and f"{method} is not allowed on {path}" in error["message"]


def test_head_is_answered_where_get_is(client: TestClient) -> None:
    """HEAD asks for a GET's status and headers (RFC 9110), which FastAPI's GET routes answered with a 405."""
    for path in ("/v1/models", "/health", "/ready", "/metrics", "/version"):
        head, get = client.head(path), client.get(path)
        assert head.status_code == get.status_code == 200, (path, head.text)
        assert head.headers["content-type"] == get.headers["content-type"]
    response = client.head("/v1/completions")
    assert response.status_code == 405 and response.headers["allow"] == "POST"
    assert client.head("/v1/nope").status_code == 404


def test_model_name_may_be_given_or_omitted(client: TestClient) -> None:
    assert complete(client, prompt="a", model=TINY, max_tokens=1)["model"] == TINY
    assert complete(client, prompt="a", max_tokens=1)["model"] == TINY


def test_state_memory_budget_sizes_the_pool() -> None:
    config = tiny_config(max_num_seqs=None, state_memory=4 * 2560 + 100)  # mingru-tiny: 2560 B a slot, one scratch
    with TestClient(create_app(config)) as client:
        text = client.get("/metrics").text
    label = f'{{model_name="{TINY}"}}'
    assert f"rnnserve_state_slots{label} 3.0" in text
    assert f"rnnserve_state_memory_total_bytes{label} 7680.0" in text
