"""What the official ``openai`` SDK and OpenAI-shaped clients send and expect, beyond the basic shapes of
test_api.py: nullable fields, the end of a tool-call stream, functions without parameters, the fields an
error names, constraints beside ``allowed_token_ids``, stop token text and text offsets."""

from __future__ import annotations

import codecs
import json
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from rnnserve.engine.chat_template import render_chat
from rnnserve.engine.sampling_params import InvalidParameterError
from rnnserve.engine.tokenizer import ByteTokenizer
from rnnserve.server.app import create_app
from rnnserve.server.background import serve_in_thread
from rnnserve.server.streaming import required_calls
from tests.server.conftest import tiny_config
from tests.server.test_api import CLOCK, WEATHER, events

pytestmark = pytest.mark.timeout(120)

CHAT = {"messages": [{"role": "user", "content": "Weather?"}], "temperature": 1.0, "max_tokens": 80}


@pytest.fixture(scope="module")
def short_client() -> Iterator[TestClient]:
    """A server whose sequences end at 24 tokens (``--max-model-len 24``)."""
    with TestClient(create_app(tiny_config(max_model_len=24, max_prompt_tokens=24))) as test_client:
        yield test_client


def test_nullable_fields_sent_as_null_read_as_left_out(client: TestClient) -> None:
    """OpenAI declares ``n``, ``stream``, ``echo``, ``logprobs`` (chat) and ``include_usage`` nullable, and the
    SDK sends an explicit ``None`` as ``null``: each is its default, not a 400."""
    base = {"prompt": "Hello", "temperature": 0, "max_tokens": 3}
    plain = client.post("/v1/completions", json=base).json()["choices"][0]["text"]
    for field in ("n", "stream", "echo"):
        response = client.post("/v1/completions", json={**base, field: None})
        assert response.status_code == 200, (field, response.text)
        assert response.json()["choices"][0]["text"] == plain
    chat = {"messages": [{"role": "user", "content": "Hi"}], "temperature": 0, "max_tokens": 3}
    for field in ("n", "stream", "logprobs"):
        response = client.post("/v1/chat/completions", json={**chat, field: None})
        assert response.status_code == 200, (field, response.text)
        assert response.json()["choices"][0]["logprobs"] is None
    streamed = client.post("/v1/completions", json={**base, "stream": True, "stream_options": {"include_usage": None}})
    assert streamed.status_code == 200 and all(
        "usage" not in e for e in events(streamed.text)[:-1]
    ), "include_usage null is false"
    response = client.post("/v1/completions", json={**base, "n": "2"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "n"  # still typed strictly


def test_a_stream_of_tool_calls_ends_with_a_chunk_of_its_own(client: TestClient) -> None:
    """``required`` calls arrive whole with the sample's end: the chunk with the calls has no finish_reason, the
    next one (empty delta) has it, as OpenAI's streams end; the opening chunk's content is null."""
    body = {**CHAT, "tools": [WEATHER, CLOCK], "tool_choice": "required", "parallel_tool_calls": False, "stream": True}
    for seed in range(3):
        chunks = [e for e in events(client.post("/v1/chat/completions", json={**body, "seed": seed}).text)[:-1]]
        opening = chunks[0]["choices"][0]
        assert opening["delta"] == {"role": "assistant", "content": None}
        with_calls = [i for i, c in enumerate(chunks) if "tool_calls" in c["choices"][0]["delta"]]
        assert len(with_calls) == 1, chunks
        calls_chunk, closing = chunks[with_calls[0]], chunks[with_calls[0] + 1]
        assert calls_chunk["choices"][0]["finish_reason"] is None
        assert closing["choices"] == [
            {"index": 0, "delta": {}, "finish_reason": "tool_calls", "logprobs": None, "stop_reason": None}
        ]
        assert chunks[-1] is closing


def test_the_sdk_stream_helper_closes_every_forced_call() -> None:
    """The SDK's ``chat.completions.stream`` fires ``tool_calls.function.arguments.done`` for the call of a
    ``required`` answer (with the calls and the finish_reason in one chunk it never did)."""
    openai = pytest.importorskip("openai")
    with serve_in_thread(create_app(tiny_config())) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        done, content = [], []
        for seed in range(2):
            with client.chat.completions.stream(
                model="random:mingru-tiny", messages=CHAT["messages"], max_tokens=80, seed=seed,
                tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
            ) as stream:  # fmt: skip
                for event in stream:
                    if event.type == "tool_calls.function.arguments.done":
                        done.append((event.name, json.loads(event.arguments)))
                message = stream.get_final_completion().choices[0].message
            content.append(message.content)
    assert [name for name, _ in done] == ["get_weather"] * 2
    assert all(set(arguments) == {"city", "days"} for _, arguments in done)
    assert content == [None, None]


def test_a_function_without_parameters_is_called_with_an_empty_object(client: TestClient) -> None:
    """OpenAI: omitting ``parameters`` defines a function with an empty parameter list: its arguments are
    ``{}``, never keys the model made up."""
    body = {**CHAT, "tools": [CLOCK], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}
    for seed in range(6):
        choice = client.post("/v1/chat/completions", json={**body, "seed": seed}).json()["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]) == {}


def test_length_limits_name_what_the_client_sent(short_client: TestClient) -> None:
    prompt = "x" * 20  # 20 tokens of 24
    fitted = short_client.post("/v1/completions", json={"prompt": prompt, "temperature": 0})
    assert fitted.status_code == 200, fitted.text  # the default 16 is cut to the room left, as docs/api.md says
    assert fitted.json()["usage"]["completion_tokens"] == 4 and fitted.json()["choices"][0]["finish_reason"] == "length"
    explicit = short_client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 16})
    assert explicit.status_code == 400 and explicit.json()["error"]["param"] == "max_tokens"
    chat = {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 24}
    response = short_client.post("/v1/chat/completions", json=chat)
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == "max_completion_tokens", error
    assert "max_completion_tokens (24)" in error["message"] and "max_tokens (" not in error["message"]
    full = short_client.post("/v1/completions", json={"prompt": "x" * 24, "max_tokens": 0, "echo": True})
    error = full.json()["error"]
    assert full.status_code == 400 and error["param"] == "prompt" and "echo with max_tokens 0" in error["message"]
    assert "max_tokens (1)" not in error["message"]
    scored = short_client.post("/v1/completions", json={"prompt": "x" * 23, "max_tokens": 0, "echo": True})
    assert scored.status_code == 200 and scored.json()["choices"][0]["text"] == "x" * 23


def test_allowed_token_ids_beside_a_constraint(client: TestClient) -> None:
    """Ids that leave the constraint no first token are a 400 (it was a 500, retried by the SDK); where they
    run out later the constraint wins, as it does over ``min_tokens``."""
    choice = {"structured_outputs": {"choice": ["yes", "no"]}, "max_tokens": 8, "temperature": 1.0}
    body = {"prompt": "Answer:", **choice, "allowed_token_ids": [ord("a")]}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 400 and response.json()["error"]["param"] == "allowed_token_ids", response.text
    for seed in range(4):
        body = {"prompt": "Answer:", **choice, "allowed_token_ids": [ord("y"), ord("n")], "seed": seed}
        response = client.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] in ("yes", "no")


def test_logit_bias_cannot_favour_a_padding_row(client: TestClient) -> None:
    """random:mingru-tiny has 320 rows for 257 tokens: a positive bias on a padding row would sample empty
    text (as prompts and allowed_token_ids, it is a 400); a ban is harmless and accepted."""
    favour = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "logit_bias": {"300": 100}})
    assert favour.status_code == 400 and favour.json()["error"]["param"] == "logit_bias", favour.text
    ban = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "logit_bias": {"300": -100}})
    assert ban.status_code == 200


@pytest.mark.parametrize("stream", [False, True])
def test_include_stop_str_in_output_keeps_a_stop_token_text(client: TestClient, stream: bool) -> None:
    """vLLM: the output holds a (non-special) stop token's text with ``include_stop_str_in_output``."""
    base = {"prompt": "Hello", "temperature": 0, "max_tokens": 8, "stream": stream}
    first = client.post("/v1/completions", json={**base, "stream": False, "max_tokens": 1}).json()
    stop_id = ord(first["choices"][0]["text"])

    def text(**extra: object) -> tuple[str, str]:
        response = client.post("/v1/completions", json={**base, "stop_token_ids": [stop_id], **extra})
        if not stream:
            return response.json()["choices"][0]["text"], response.json()["choices"][0]["finish_reason"]
        choices = [e["choices"][0] for e in events(response.text)[:-1]]
        return "".join(c["text"] for c in choices), choices[-1]["finish_reason"]

    assert text() == ("", "stop")
    assert text(include_stop_str_in_output=True) == (chr(stop_id), "stop")


def test_text_offsets_count_characters_of_the_returned_text(client: TestClient) -> None:
    """A byte-level vocabulary splits "é" and "日" into bytes: those bytes share their character's offset, and
    every offset indexes the response's ``text``."""
    prompt = "café 日本 ok"
    body = {"prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 6, "temperature": 0}
    choice = client.post("/v1/completions", json=body).json()["choices"][0]
    lp, text = choice["logprobs"], choice["text"]
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    expected, chars = [], 0
    for token in text.encode():  # one token per byte here, prompt and output
        expected.append(chars)
        chars += len(decoder.decode(bytes([token])))
    assert lp["text_offset"][: len(prompt.encode())] == [0, 1, 2, 3, 3, 4, 5, 5, 5, 6, 6, 6, 7, 8, 9]
    assert len(lp["text_offset"]) == len(lp["tokens"]) and all(o <= len(text) for o in lp["text_offset"])
    if len(lp["tokens"]) == len(text.encode()):  # the generated bytes formed whole characters
        assert lp["text_offset"] == expected
    response = client.post("/v1/completions", json={**body, "stream": True})
    offsets = [o for e in events(response.text)[:-1] if e["choices"] and e["choices"][0]["logprobs"]
               for o in e["choices"][0]["logprobs"]["text_offset"]]  # fmt: skip
    assert offsets == lp["text_offset"]


@pytest.mark.parametrize(
    ("guided", "check"),
    [
        ({"guided_choice": ["yes", "no"]}, lambda text: text in ("yes", "no")),
        ({"guided_regex": "[0-9]{3}"}, lambda text: len(text) == 3 and text.isdigit()),
        ({"guided_json": {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"],
                          "additionalProperties": False}}, lambda text: set(json.loads(text)) == {"a"}),
        ({"guided_grammar": 'start: "ab" | "cd"'}, lambda text: text in ("ab", "cd")),
    ],
)
def test_vllm_guided_fields_constrain_the_output(client: TestClient, guided: dict, check) -> None:
    """vLLM's ``guided_*`` spelling was answered 200 and ignored: the output was unconstrained."""
    for seed in range(3):
        body = {"prompt": "Answer:", "max_tokens": 24, "temperature": 1.0, "seed": seed, **guided}
        response = client.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        assert check(response.json()["choices"][0]["text"]), response.json()


def test_guided_fields_conflicts_and_deprecated_functions_are_400s(client: TestClient) -> None:
    for body, param in (
        ({"guided_choice": ["a"], "structured_outputs": {"choice": ["b"]}}, "guided_choice"),
        ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_choice"),
        ({"guided_regex": "a", "guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
        ({"guided_regex": "("}, "guided_regex"),
    ):
        response = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, **body})
        assert response.status_code == 400 and response.json()["error"]["param"] == param, (body, response.text)
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    for body, param in (({"functions": [CLOCK["function"]]}, "functions"),
                        ({"function_call": {"name": "get_time"}}, "function_call")):  # fmt: skip
        response = client.post("/v1/chat/completions", json={**chat, **body})
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
        assert "tools" in response.json()["error"]["message"] or "tool_choice" in response.json()["error"]["message"]


@pytest.mark.parametrize("engine_process", ["off", "on"])
def test_stop_reason_names_the_stop_that_ended_a_choice(engine_process: str) -> None:
    """vLLM's ``stop_reason``: the stop token id or stop string that ended a choice, ``null`` for EOS and
    ``length``; in a stream, on the chunk with the finish_reason. It crosses the engine process's rows."""
    with TestClient(create_app(tiny_config(engine_process=engine_process))) as client:
        base = {"prompt": "Hello", "temperature": 0, "max_tokens": 8}
        plain = client.post("/v1/completions", json=base).json()["choices"][0]
        assert plain["finish_reason"] == "length" and plain["stop_reason"] is None
        stop_id = ord(plain["text"][0])
        stop_string = plain["text"][2:4]
        stops = (({"stop_token_ids": [stop_id]}, stop_id), ({"stop": ["never", stop_string]}, stop_string))
        for extra, reason in stops:
            choice = client.post("/v1/completions", json={**base, **extra}).json()["choices"][0]
            assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", reason), choice
            chunks = [e["choices"][0] for e in events(
                client.post("/v1/completions", json={**base, **extra, "stream": True}).text)[:-1]]  # fmt: skip
            assert chunks[-1]["stop_reason"] == reason and all("stop_reason" not in c for c in chunks[:-1])
            chat = {"messages": [{"role": "user", "content": "Hi"}], "temperature": 0, "max_tokens": 8}
            message = client.post("/v1/chat/completions", json=chat).json()["choices"][0]
            assert message["stop_reason"] is None


def test_cors_is_off_unless_origins_are_allowed(client: TestClient) -> None:
    preflight = {"Origin": "http://app.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}  # fmt: skip
    assert "access-control-allow-origin" not in client.options("/v1/completions", headers=preflight).headers
    config = tiny_config(allowed_origins=["http://app.example"], api_key="secret")
    with TestClient(create_app(config)) as cors:
        answer = cors.options("/v1/completions", headers=preflight)  # no API key: a preflight carries none
        assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == "http://app.example"
        body = {"prompt": "Hi", "max_tokens": 1}
        headers = {"Origin": "http://app.example", "Authorization": "Bearer secret"}
        response = cors.post("/v1/completions", json=body, headers=headers)
        assert response.status_code == 200 and response.headers["access-control-allow-origin"] == "http://app.example"
        other = cors.options("/v1/completions", headers={**preflight, "Origin": "http://evil.example"})
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
        unauthorised = cors.post("/v1/completions", json=body, headers={"Origin": "http://app.example"})
        assert unauthorised.status_code == 401


def test_cors_preflight_takes_the_headers_openai_sdks_send() -> None:
    """The openai SDKs (Stainless-generated) add headers of their own to every request: a preflight that refused
    them kept every browser client built on the SDKs out."""
    sdk_headers = "authorization, content-type, openai-organization, x-stainless-os, x-stainless-retry-count"
    preflight = {"Origin": "http://app.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": sdk_headers}  # fmt: skip
    with TestClient(create_app(tiny_config(allowed_origins=["http://app.example"]))) as cors:
        answer = cors.options("/v1/chat/completions", headers=preflight)
        assert answer.status_code == 200, answer.text
        allowed = {h.strip() for h in answer.headers["access-control-allow-headers"].lower().split(",")}
        assert set(sdk_headers.split(", ")) <= allowed


def test_a_refused_cors_preflight_has_openais_error_body() -> None:
    """A preflight from an origin that is not allowed, or for a method no route takes: OpenAI's 400, not plain text."""
    other_origin = {"Origin": "http://evil.example", "Access-Control-Request-Method": "POST"}
    other_method = {"Origin": "http://app.example", "Access-Control-Request-Method": "PATCH"}
    with TestClient(create_app(tiny_config(allowed_origins=["http://app.example"]))) as cors:
        for headers, refused in ((other_origin, "origin"), (other_method, "method")):
            answer = cors.options("/v1/completions", headers=headers)
            assert answer.status_code == 400 and answer.headers["content-type"] == "application/json"
            error = answer.json()["error"]
            assert error["code"] == "cors_disallowed" and refused in error["message"], error
        assert "access-control-allow-origin" not in cors.options("/v1/models", headers=other_origin).headers


def test_a_cors_preflight_asking_for_private_network_access_is_granted_to_allowed_origins() -> None:
    """Chrome asks, in the preflight of a public page's request to a loopback or private address, for Private
    Network Access: Starlette refused every such preflight (400 "Disallowed CORS private-network"), so an allowed
    page could not call a server on the user's machine."""
    preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "content-type"}  # fmt: skip
    asking = {**preflight, "Access-Control-Request-Private-Network": "true"}
    for origins in (["https://app.example"], ["*"]):
        with TestClient(create_app(tiny_config(allowed_origins=origins))) as cors:
            answer = cors.options("/v1/chat/completions", headers=asking)
            assert answer.status_code == 200, answer.text
            assert answer.headers["access-control-allow-private-network"] == "true"
            assert answer.headers["access-control-allow-origin"] in ("https://app.example", "*")
            not_asking = cors.options("/v1/chat/completions", headers=preflight)
            assert not_asking.status_code == 200 and "access-control-allow-private-network" not in not_asking.headers
    other_origin = {**asking, "Origin": "https://evil.example"}
    other_method = {**asking, "Access-Control-Request-Method": "PATCH"}
    with TestClient(create_app(tiny_config(allowed_origins=["https://app.example"]))) as cors:
        for refused in (other_origin, other_method):
            answer = cors.options("/v1/chat/completions", headers=refused)
            assert answer.status_code == 400 and answer.json()["error"]["code"] == "cors_disallowed"
            assert "access-control-allow-private-network" not in answer.headers


def test_required_tool_calls_take_tools_whose_parameters_use_defs(client: TestClient) -> None:
    """``tool_choice: "required"`` put every tool's schema under one root, where a pydantic tool's ``#/$defs/...``
    references no longer resolved: a 400 for any tool with an enum or a nested model."""
    unit = {"$defs": {"Unit": {"enum": ["c", "f"], "type": "string"}}, "type": "object",
            "properties": {"unit": {"$ref": "#/$defs/Unit"}}, "required": ["unit"],
            "additionalProperties": False}  # fmt: skip
    tool = {"type": "function", "function": {"name": "set_unit", "parameters": unit}}
    body = {"messages": [{"role": "user", "content": "Hi"}], "tools": [tool, WEATHER], "tool_choice": "required",
            "max_tokens": 60, "temperature": 1.0}  # fmt: skip
    for seed in range(3):
        response = client.post("/v1/chat/completions", json={**body, "seed": seed})
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        if choice["finish_reason"] == "tool_calls":
            for call in choice["message"]["tool_calls"]:
                arguments = json.loads(call["function"]["arguments"])
                assert arguments["unit"] in ("c", "f") if call["function"]["name"] == "set_unit" else arguments


def test_required_call_arguments_are_the_generated_text() -> None:
    """Parsed and written again, a number beyond a float's range became ``Infinity`` (not JSON), long decimals
    were rounded and repeated keys dropped: the arguments are now the generated text itself."""
    text = '[{"name": "f", "parameters": {"x": 156E1099322632124816, "y": 0.12345678901234567890, "y": 1}}, ' \
           '{"name": "g", "parameters": {}}]'  # fmt: skip
    assert required_calls(text) == [
        ("f", '{"x": 156E1099322632124816, "y": 0.12345678901234567890, "y": 1}'), ("g", "{}")
    ]
    for broken in ('[{"name": "f", "parameters": {}}', '[{"name": "f"}]', "{}", '[{"name": 1, "parameters": {}}]'):
        assert required_calls(broken) is None


@pytest.mark.parametrize("schema", ['{"const": NaN}', '{"const": Infinity}', '{"enum": [1e400]}'])
def test_a_schema_with_numbers_that_are_not_json_is_a_400(client: TestClient, schema: str) -> None:
    """Python's JSON reader takes NaN, Infinity and 1e400; in the generated JSON they came out as ``null``."""
    body = f'{{"prompt": "x", "max_tokens": 4, "response_format": {{"type": "json_schema", "json_schema": ' \
           f'{{"name": "s", "schema": {schema}}}}}}}'  # fmt: skip
    response = client.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == 400, response.text


def test_continue_final_message_needs_add_generation_prompt_false(client: TestClient) -> None:
    """vLLM's rule: continuing the final message and starting a reply after the generation prompt exclude each
    other; ``add_generation_prompt`` defaults to true, so a continuation sends it false (chat and /tokenize)."""
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Sure"}]
    both = {"messages": messages, "continue_final_message": True}
    for path, body in (("/v1/chat/completions", {**both, "max_tokens": 2}), ("/tokenize", both)):
        response = client.post(path, json=body)
        assert response.status_code == 400, (path, response.text)
        assert response.json()["error"]["param"] == "continue_final_message"
    tokens = client.post("/tokenize", json={**both, "add_generation_prompt": False}).json()["tokens"]
    assert client.post("/detokenize", json={"tokens": tokens}).json()["prompt"] == "User: Hi\nAssistant:Sure"
    reply = client.post("/v1/chat/completions", json={**both, "add_generation_prompt": False, "max_tokens": 2})
    assert reply.status_code == 200 and reply.json()["usage"]["prompt_tokens"] == len(tokens)


def test_continue_final_message_that_the_template_leaves_out_is_an_error() -> None:
    """The reply continues the final message's content; a template that does not render it (nor its stripped
    text, as templates that trim messages do) has nothing to continue: an error on ``continue_final_message``,
    not a reply after the whole rendered chat."""
    tokenizer = ByteTokenizer()
    trimming = "{% for m in messages %}<{{ m.role }}>{{ m.content | trim }}</s>{% endfor %}"
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": " Sure "}]
    assert render_chat(tokenizer, messages, False, True, trimming) == "<user>Hi</s><assistant>Sure"
    with pytest.raises(InvalidParameterError) as err:
        render_chat(tokenizer, messages, False, True, "{% for m in messages %}<{{ m.role }}>{% endfor %}")
    assert err.value.param == "continue_final_message"


def test_fields_inside_messages_and_tools_are_typed_strictly(client: TestClient) -> None:
    """As the top-level fields: a function's ``strict`` sent as ``"yes"`` or ``1`` was read as true."""
    function = {"name": "f", "parameters": {"type": "object", "properties": {}, "additionalProperties": False}}
    body = {"messages": [{"role": "user", "content": "Hi"}], "tool_choice": "required", "max_tokens": 2}
    for strict in ("yes", 1, "true"):
        tools = [{"type": "function", "function": {**function, "strict": strict}}]
        response = client.post("/v1/chat/completions", json={**body, "tools": tools})
        assert response.status_code == 400 and response.json()["error"]["param"] == "tools", (strict, response.text)
    tools = [{"type": "function", "function": {**function, "strict": True}}]
    assert client.post("/v1/chat/completions", json={**body, "tools": tools}).status_code == 200
