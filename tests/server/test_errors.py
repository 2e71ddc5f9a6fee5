"""Each client mistake gets an OpenAI error body with the right status; engine failures never hang streams."""

from __future__ import annotations

import asyncio
import gzip
import json
import socket
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from rnnserve.engine.config import EngineConfig
from rnnserve.engine.llm_engine import LLMEngine
from rnnserve.engine.loader import load_model
from rnnserve.engine.scheduler import QueueFullError
from rnnserve.engine.tokenizer import CharTokenizer
from rnnserve.server.app import create_app
from rnnserve.server.background import serve_in_thread
from rnnserve.server.errors import InternalErrors
from rnnserve.server.routes import OpenAIServing
from tests.engine.test_structured_output import right_recursive
from tests.server.conftest import TINY, tiny_config

pytestmark = pytest.mark.timeout(60)
JSON = {"Content-Type": "application/json"}


def assert_error(response, status: int, param: str | None = None) -> dict:  # type: ignore[no-untyped-def]
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


BAD_COMPLETIONS = [
    ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "temperature": -0.5}, "temperature"),
    ({"prompt": "x", "temperature": 101}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "top_p": 1.5}, "top_p"),
    ({"prompt": "x", "presence_penalty": 3}, "presence_penalty"),
    ({"prompt": "x", "frequency_penalty": -3}, "frequency_penalty"),
    ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": "x", "min_p": 2}, "min_p"),
    ({"prompt": "x", "top_k": -2}, "top_k"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "n": 5}, "n"),  # more samples than the server's 4 state slots
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "min_tokens": 50, "max_tokens": 5}, "min_tokens"),
    ({"prompt": "x", "seed": 2**64}, "seed"),
    ({"prompt": "x", "stop": ["a"] * 17}, "stop"),
    ({"prompt": "x", "stop_token_ids": [10**6]}, "stop_token_ids"),
    ({"prompt": "x", "max_tokens": "many"}, "max_tokens"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "stream": "yes"}, "stream"),
    ({"prompt": "x", "stop": 5}, "stop"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [[]]}, "prompt"),
    ({"prompt": ["ok", ""]}, "prompt"),
    ({"prompt": [-1]}, "prompt"),
    ({"prompt": [400]}, "prompt"),
    ({"prompt": "y" * 65}, "prompt"),  # the fixture's max_prompt_tokens is 64
    ({}, "prompt"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "x", "logit_bias": {"1": "2"}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"one": 2}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"-1": 2}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"400": 2}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": [1, 2]}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"1" * 5000: 2}}, "logit_bias"),  # past int()'s 4300 digits
    ({"prompt": "x", "allowed_token_ids": []}, "allowed_token_ids"),
    ({"prompt": "x", "allowed_token_ids": [400]}, "allowed_token_ids"),
    ({"prompt": "x", "allowed_token_ids": [65, 300]}, "allowed_token_ids"),  # a padding row: no text
    ({"prompt": "x", "allowed_token_ids": [-1]}, "allowed_token_ids"),
    ({"prompt": "x", "allowed_token_ids": [1], "stop_token_ids": [1], "min_tokens": 2}, "allowed_token_ids"),
    ({"prompt": "x", "suffix": "tail"}, "suffix"),
    ({"prompt": "x", "structured_outputs": {}}, "structured_outputs"),
    ({"prompt": "x", "structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"prompt": "x", "structured_outputs": {"regex": "(a"}}, "structured_outputs"),
    ({"prompt": "x", "structured_outputs": {"regex": 5}}, "structured_outputs"),
    ({"prompt": "x", "structured_outputs": {"choice": []}}, "structured_outputs"),
    ({"prompt": "x", "structured_outputs": {"choice": ["a", 1]}}, "structured_outputs"),
    ({"prompt": "x", "structured_outputs": {"choice": "abc"}}, "structured_outputs"),
    ({"prompt": "x", "structured_outputs": {"regex": "a{1000000}"}}, "structured_outputs"),  # the lexer's limit
    ({"prompt": "x", "structured_outputs": {"grammar": "start: undefined_rule"}}, "structured_outputs"),
    ({"prompt": "x", "structured_outputs": {"json": "{not json"}}, "structured_outputs"),
    ({"prompt": "x", "structured_outputs": {"json": [1]}}, "structured_outputs"),
    ({"prompt": "x", "structured_outputs": {"json_object": "yes"}}, "structured_outputs"),
    ({"prompt": "x", "structured_outputs": {"regex": "a", "structural_tag": "t"}}, "structured_outputs"),
    ({"prompt": "x", "structured_outputs": "a"}, "structured_outputs"),
    ({"prompt": "x", "structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
     "structured_outputs"),  # fmt: skip
    ({"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}}, "response_format"),
]


@pytest.mark.parametrize(("body", "param"), BAD_COMPLETIONS, ids=[p for _, p in BAD_COMPLETIONS])
@pytest.mark.parametrize("stream", [False, True])
def test_invalid_completion_parameters_are_400(client: TestClient, body: dict, param: str, stream: bool) -> None:
    if stream and param not in ("stream", "stream_options"):
        body = {**body, "stream": True}
    error = assert_error(client.post("/v1/completions", json=body), 400, param)
    assert error["type"] == "invalid_request_error"


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def NAMED(name: str) -> dict:  # noqa: N802 - reads as a constant in the table below
    return {"type": "function", "function": {"name": name}}


BAD_CHATS = [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "u"}]}]}, "messages"),
    ({"messages": "hello"}, "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -5}, "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [TOOL]}, "tool_choice"),  # auto: no parser
    ({"messages": [{"role": "user", "content": "x"}], "tools": [TOOL], "tool_choice": "auto"}, "tool_choice"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [TOOL], "tool_choice": "always"}, "tool_choice"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [TOOL], "tool_choice": NAMED("other")}, "tool_choice"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, "tools"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": NAMED("f")}, "tools"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "retrieval", "function": {"name": "f"}}],
      "tool_choice": "required"}, "tools"),  # fmt: skip
    ({"messages": [{"role": "user", "content": "x"}], "tools": [TOOL, TOOL], "tool_choice": "required"}, "tools"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "a b"}}],
      "tool_choice": "required"}, "tools"),  # fmt: skip
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "f",
      "parameters": {"type": "object", "properties": {"a": {"type": "bogus"}}}}}], "tool_choice": NAMED("f")},
     "tools"),  # fmt: skip
    ({"messages": [{"role": "user", "content": "x"}], "tools": [TOOL], "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "response_format"),  # fmt: skip
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}}, "response_format"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema"}}, "response_format"),
    (
        {"messages": [{"role": "user", "content": "x"}],
         "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "nonsense"}}}},
        "response_format",
    ),  # fmt: skip
    ({"messages": [{"role": "user", "content": "y" * 80}]}, "messages"),  # the field sent, as OpenAI names it
]


@pytest.mark.parametrize(("body", "param"), BAD_CHATS, ids=[p for _, p in BAD_CHATS])
def test_invalid_chat_parameters_are_400(client: TestClient, body: dict, param: str) -> None:
    assert_error(client.post("/v1/chat/completions", json=body), 400, param)


def test_malformed_bodies_are_400(client: TestClient) -> None:
    assert_error(client.post("/v1/completions", content=b"{not json", headers=JSON), 400)
    assert_error(client.post("/v1/completions", content=b"[1, 2]", headers=JSON), 400)
    nan = b'{"prompt": "x", "temperature": NaN}'
    assert_error(client.post("/v1/completions", content=nan, headers=JSON), 400, "temperature")
    assert_error(client.post("/tokenize", json={}), 400, "prompt")
    assert_error(client.post("/detokenize", json={"tokens": [999]}), 400, "tokens")
    assert_error(client.post("/detokenize", json={"tokens": "abc"}), 400, "tokens")


def test_detokenize_refuses_the_ids_a_prompt_may_not_hold(client: TestClient) -> None:
    """mingru-tiny's 320 vocabulary rows pad its byte tokenizer's 257 ids: a padding row is refused in a prompt,
    and /detokenize, which gave it as "" (text that is no token's), refuses it too."""
    assert_error(client.post("/v1/completions", json={"prompt": [72, 300]}), 400, "prompt")
    error = assert_error(client.post("/detokenize", json={"tokens": [72, 300]}), 400, "tokens")
    assert "300" in error["message"]
    assert client.post("/detokenize", json={"tokens": [72, 256]}).json() == {"prompt": "H"}


def test_unknown_model_is_404(client: TestClient) -> None:
    for path, body in (
        ("/v1/completions", {"prompt": "x"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
        ("/tokenize", {"prompt": "x"}),
    ):
        error = assert_error(client.post(path, json={**body, "model": "gpt-17"}), 404, "model")
        assert error["code"] == "model_not_found"
    assert_error(client.get("/v1/models/gpt-17"), 404)
    assert_error(client.get("/no/such/route"), 404)


def test_oversized_body_is_413(client: TestClient) -> None:
    big = json.dumps({"prompt": "x" * 10_000}).encode()  # fixture limit: 8192 bytes
    assert_error(client.post("/v1/completions", content=big, headers=JSON), 413)

    def chunked():  # no Content-Length: the limit is enforced while reading
        for _ in range(10):
            yield b" " * 1000

    assert_error(client.post("/v1/completions", content=chunked(), headers=JSON), 413)
    assert client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 200


def test_api_key_is_required_when_set() -> None:
    with TestClient(create_app(tiny_config(api_key="s3cret"))) as client:
        body = {"prompt": "x", "max_tokens": 1}
        assert_error(client.post("/v1/completions", json=body), 401)
        assert_error(client.post("/v1/completions", json=body, headers={"Authorization": "Bearer wrong"}), 401)
        assert_error(client.post("/v1/completions", json=body, headers={"Authorization": "s3cret"}), 401)
        assert_error(client.get("/v1/models"), 401)
        assert_error(client.post("/tokenize", json={"prompt": "x"}), 401)
        bad_key = {**JSON, "Authorization": "Bearer no"}
        assert_error(client.post("/v1/completions", content=b"{bad", headers=bad_key), 401)
        ok = {"Authorization": "Bearer s3cret"}
        assert client.post("/v1/completions", json=body, headers=ok).status_code == 200
        assert client.get("/v1/models", headers=ok).json()["data"][0]["id"] == TINY
        assert client.get("/health").status_code == 200 and client.get("/metrics").status_code == 200


def test_post_bodies_must_be_json(client: TestClient) -> None:
    body = json.dumps({"prompt": "x", "max_tokens": 1}).encode()
    for content_type in (None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        headers = {"Content-Type": content_type} if content_type else {}
        error = assert_error(client.post("/v1/completions", content=body, headers=headers), 415)
        assert error["code"] == "unsupported_media_type"
    ok = client.post("/v1/completions", content=body, headers={"Content-Type": "Application/JSON; charset=utf-8"})
    assert ok.status_code == 200


def test_compressed_bodies_are_a_415_not_invalid_json(client: TestClient) -> None:
    """A body sent with a Content-Encoding (``gzip``, ...) is read as sent: it was a 400 "not valid JSON", which
    sent its client looking for a bug in its JSON."""
    body = json.dumps({"prompt": "x", "max_tokens": 1}).encode()
    for encoding in ("gzip", "deflate", "br", "GZIP"):
        headers = {**JSON, "Content-Encoding": encoding}
        error = assert_error(client.post("/v1/completions", content=gzip.compress(body), headers=headers), 415)
        assert error["code"] == "unsupported_media_type" and encoding.lower() in error["message"]
    for encoding in ("identity", ""):
        ok = client.post("/v1/completions", content=body, headers={**JSON, "Content-Encoding": encoding})
        assert ok.status_code == 200, ok.text


def test_host_header_is_checked(client: TestClient) -> None:
    for host in ("evil.example", "evil.example:8000", "10.1.2.3"):
        assert assert_error(client.get("/v1/models", headers={"Host": host}), 400)["code"] == "invalid_host"
    for host in ("localhost:8000", "127.0.0.1", "[::1]:8000", "LOCALHOST"):
        assert client.get("/v1/models", headers={"Host": host}).status_code == 200


def test_probes_and_scrapes_answer_any_host() -> None:
    """kubelet's probes and Prometheus name a pod by its address, a container's HEALTHCHECK by 127.0.0.1: with
    --allowed-hosts set to a service name (as docs/deploy.md advises) they all got 400."""
    with TestClient(create_app(tiny_config(allowed_hosts=["api.example"])), base_url="http://api.example") as client:
        for path in ("/health", "/ready", "/metrics"):
            assert client.get(path, headers={"Host": "10.1.2.3:8000"}).status_code == 200, path
        assert client.get("/v1/models", headers={"Host": "10.1.2.3:8000"}).status_code == 400


@pytest.mark.parametrize(
    ("options", "accepted", "rejected"),
    [
        ({"host": "0.0.0.0"}, ["10.1.2.3:80", "[fe80::1]", "localhost"], ["evil.example"]),
        ({"allowed_hosts": ["api.example"]}, ["api.example:443"], ["localhost", "127.0.0.1"]),
        ({"allowed_hosts": ["*"]}, ["evil.example", "localhost"], []),
    ],
)
def test_allowed_hosts(options: dict, accepted: list[str], rejected: list[str]) -> None:
    with TestClient(create_app(tiny_config(**options)), base_url="http://localhost") as client:
        assert [h for h in accepted if client.get("/v1/models", headers={"Host": h}).status_code != 200] == []
        assert [h for h in rejected if client.get("/v1/models", headers={"Host": h}).status_code != 400] == []


def test_models_do_not_expose_local_paths(tmp_path) -> None:  # type: ignore[no-untyped-def]
    config = tiny_config()
    assert config.model_root == TINY  # a model id is not a path: reported as given
    (tmp_path / "my-model").mkdir()
    config.engine.model = str(tmp_path / "my-model")
    assert config.model_root == config.model_names[0] == "my-model"
    config.engine.model = None
    assert config.model_root == "rnnserve-default"


def test_engine_failure_ends_the_stream_with_an_error_and_frees_slots() -> None:
    app = create_app(tiny_config())
    engine = app.state.engine.engine
    real_step = engine.step
    calls = {"n": 0}

    def failing_step(collect: bool = True):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("device fell over")
        return real_step(collect)

    engine.step = failing_step
    with TestClient(app) as client:
        body = {"prompt": "Hello", "max_tokens": 50, "ignore_eos": True, "stream": True}
        lines = [line for line in client.post("/v1/completions", json=body).text.splitlines() if line]
        assert lines[-1] == "data: [DONE]"
        error = json.loads(lines[-2][len("data: ") :])["error"]
        assert "device fell over" in error["message"]
        non_stream = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3, "ignore_eos": True})
        assert non_stream.status_code == 200 and non_stream.json()["usage"]["completion_tokens"] == 3
        assert engine.pool.num_used == 0  # the failed request's abort ran before the next request's add


def test_text_the_tokenizer_rejects_is_400() -> None:
    model, _ = load_model(TINY, device="cpu")
    engine = LLMEngine(model, CharTokenizer("abc"), EngineConfig(max_num_seqs=2))
    with TestClient(create_app(tiny_config(), engine=engine)) as client:
        assert_error(client.post("/v1/completions", json={"prompt": "abz"}), 400, "prompt")
        assert_error(client.post("/tokenize", json={"prompt": "abz"}), 400, "prompt")
        ok = client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2})
        assert ok.status_code == 200 and ok.json()["usage"]["prompt_tokens"] == 3


def test_more_prompts_than_the_queue_holds_is_400_not_429() -> None:
    """A request with more prompts than ``--max-waiting`` could never be queued: a 429 would have clients retry
    it forever."""
    with TestClient(create_app(tiny_config(max_waiting=2))) as client:
        error = assert_error(client.post("/v1/completions", json={"prompt": ["a", "b", "c"], "max_tokens": 1}), 400,
                             "prompt")  # fmt: skip
        assert "--max-waiting" in error["message"]
        response = client.post("/v1/completions", json={"prompt": ["a", "b"], "max_tokens": 1})
        assert response.status_code == 200 and len(response.json()["choices"]) == 2


def test_an_unexpected_error_is_a_500_body_and_the_connection_stays_usable(monkeypatch: pytest.MonkeyPatch) -> None:
    """An exception no handler expects is OpenAI's 500 body, and the kept-alive connection serves the next
    request (Starlette's own handler re-raised it and uvicorn closed the connection unannounced)."""

    def broken(self: object, name: str) -> dict:
        raise RuntimeError("a bug")

    monkeypatch.setattr(OpenAIServing, "model_card", broken)
    with serve_in_thread(create_app(tiny_config())) as url, socket.create_connection(url[7:].split(":")) as sock:
        reader = sock.makefile("rb")

        def get(path: str) -> tuple[int, bytes]:
            sock.sendall(f"GET {path} HTTP/1.1\r\nHost: localhost\r\n\r\n".encode())
            status = int(reader.readline().split()[1])
            length = 0
            while (line := reader.readline()) not in (b"\r\n", b""):
                name, _, value = line.decode().partition(":")
                length = int(value) if name.lower() == "content-length" else length
            return status, reader.read(length)

        status, body = get("/v1/models")
        assert status == 500 and json.loads(body)["error"]["type"] == "internal_error"
        assert get("/health")[0] == 200


def test_errors_a_retry_cannot_help_tell_openai_s_sdks_not_to_retry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """OpenAI's SDKs retry 408, 409, 429 and 5xx unless the answer says ``x-should-retry: false``: the session
    limit's 429 was sent again (twice, by default) for the same answer. A full queue, a busy session and a server
    that is not ready may answer a retry otherwise, and carry no such header."""
    app = create_app(tiny_config(session_dir=str(tmp_path), max_sessions=1))
    with TestClient(app) as client:
        session = client.post("/v1/sessions", json={}).json()["id"]
        no_retry = {
            "session limit": client.post("/v1/sessions", json={}),
            "bad parameter": client.post("/v1/completions", json={"prompt": "a", "temperature": -1}),
            "unknown model": client.post("/v1/completions", json={"prompt": "a", "model": "gpt-17"}),
            "unknown session": client.get("/v1/sessions/sess-" + "A" * 24),
            "wrong method": client.put("/v1/models"),
        }
        assert no_retry["session limit"].json()["error"]["code"] == "session_limit_reached"
        for name, response in no_retry.items():
            assert response.status_code >= 400 and response.headers.get("x-should-retry") == "false", name

        lease = app.state.sessions.acquire(session)
        busy = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1, "session_id": session})
        lease.release()
        engine = app.state.engine.engine

        def queue_full(*args: object, **kwargs: object) -> None:
            raise QueueFullError("256 requests are waiting")

        monkeypatch.setattr(engine, "add_request", queue_full)
        full = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1})
        app.state.engine.draining = True
        not_ready = client.get("/ready")
        app.state.engine.draining = False
    for response, status in ((busy, 409), (full, 429), (not_ready, 503)):
        assert response.status_code == status and "x-should-retry" not in response.headers, response.text


def test_parameters_parsed_by_fastapi_and_an_empty_model_name_get_openai_errors(client: TestClient) -> None:
    assert_error(client.get("/dashboard/stats?since=abc"), 400, "since")
    for bad in ("nan", "inf", "1e400"):  # floats, but no point in time
        assert_error(client.get(f"/dashboard/stats?since={bad}"), 400, "since")
    assert client.get("/dashboard/stats?since=1.5").status_code == 200
    assert_error(client.get("/v1/models/"), 404, "model")
    assert client.get(f"/v1/models/{TINY}").json()["id"] == TINY


@pytest.mark.parametrize("started", [False, True])
def test_internal_errors_answers_500_only_before_the_response_started(started: bool) -> None:
    """Before the start: the 500 body is the response and nothing is raised. After: the server refuses a second
    start (as uvicorn does), and the app's own exception is raised, so that the connection closes."""
    sent: list[dict] = []

    async def server_send(message: dict) -> None:
        if message["type"] == "http.response.start" and any(m["type"] == message["type"] for m in sent):
            raise RuntimeError("response already started")
        sent.append(message)

    async def app(scope: dict, receive: object, send: object) -> None:
        if started:
            await send({"type": "http.response.start", "status": 200, "headers": []})  # type: ignore[operator]
        raise KeyError("a bug")

    async def receive() -> dict:
        return {"type": "http.disconnect"}

    call = InternalErrors(app)({"type": "http", "method": "GET", "path": "/"}, receive, server_send)  # type: ignore[arg-type]
    if started:
        with pytest.raises(KeyError):
            asyncio.run(call)
        assert [m["type"] for m in sent] == ["http.response.start"]
    else:
        asyncio.run(call)
        assert sent[0]["status"] == 500 and json.loads(sent[1]["body"])["error"]["type"] == "internal_error"
        assert (b"x-should-retry", b"false") in sent[0]["headers"]  # a bug answers a retry the same way


@pytest.mark.parametrize("engine_process", ["off", "on"])
def test_a_grammar_that_meets_llguidance_s_limits_midway_is_a_400_and_frees_its_slot(engine_process: str) -> None:
    """A grammar accepted at admission whose parser meets llguidance's item limit while it generates: a 500
    ("generation failed: ValueError"), streamed as an internal error. Now the plain request is a 400 naming the
    field and the stream ends with that error event and ``[DONE]``; the slot is free and the server goes on (the
    engine in a thread or in a process of its own, whose outputs cross as rows)."""
    app = create_app(tiny_config(engine_process=engine_process))
    body = {"prompt": "x", "max_tokens": 200, "min_tokens": 100,
            "structured_outputs": {"grammar": right_recursive(40)}}  # fmt: skip
    with TestClient(app) as client:
        error = assert_error(client.post("/v1/completions", json=body), 400, "structured_outputs")
        assert error["type"] == "invalid_request_error" and "max is 2000" in error["message"]
        response = client.post("/v1/completions", json={**body, "stream": True})
        assert response.status_code == 200
        lines = [line for line in response.text.splitlines() if line]
        assert lines[-1] == "data: [DONE]"
        streamed = json.loads(lines[-2][len("data: ") :])["error"]
        assert (streamed["param"], streamed["type"]) == ("structured_outputs", "invalid_request_error")
        text = "".join(json.loads(line[len("data: ") :])["choices"][0]["text"] for line in lines[:-2])
        assert text and set(text) == {"a"}  # what came before the limit
        ok = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3, "ignore_eos": True})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
        assert 'rnnserve_state_slots_used{model_name="random:mingru-tiny"} 0.0' in client.get("/metrics").text
