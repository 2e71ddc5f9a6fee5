"""Persistent sessions over HTTP: continuation == sending the whole history (completions and chat, greedy and
seeded, streamed or not), fork, export on one replica and import on another, damaged and foreign files,
limits, one request at a time, and ``--no-sessions``.

Most tests serve random ``mingru-tiny`` weights with the token-id tokenizer (text is ``" 12 7"``), so every id
the model generates can be sent back in a prompt and texts compare token for token."""

from __future__ import annotations

import argparse
import json
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import safetensors.torch
import torch
from fastapi.testclient import TestClient

from rnnserve.engine.loader import build_random, save_checkpoint
from rnnserve.engine.outputs import RequestOutput
from rnnserve.server.app import ServerConfig, create_app
from rnnserve.server.async_engine import AsyncEngine
from rnnserve.server.background import serve_in_thread
from tests.server.conftest import tiny_config

pytestmark = pytest.mark.timeout(120)

GREEDY = {"temperature": 0}
SEEDED = {"temperature": 1.0, "seed": 1234, "top_k": 40}
TURNS: list[str | list[int]] = [[72, 105, 33, 0, 255], " 300 11 12", [10, 20, 30]]
STATE = {"Content-Type": "application/octet-stream"}
MAX_TOKENS = 6
# Chat in token ids: a user message opens with 1, an assistant one with 3 (as the generation prompt does), any
# other with 4; each ends with 2.
CHAT_TEMPLATE = (
    "{% for m in messages %} {{ {'user': 1, 'assistant': 3}.get(m['role'], 4) }}{{ m['content'] }} 2{% endfor %}"
    "{% if add_generation_prompt %} 3{% endif %}"
)


@pytest.fixture(scope="module")
def token_id_model(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Server options for a checkpoint of random mingru-tiny weights served with the token-id tokenizer."""
    path = tmp_path_factory.mktemp("token-id-model")
    model, _ = build_random("mingru-tiny", torch.device("cpu"), None)
    save_checkpoint(model, path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "tokenizer": "token_ids"}))
    (path / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return {"model": str(path), "max_prompt_tokens": None}


@pytest.fixture(scope="module")
def client(token_id_model: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    config = tiny_config(**token_id_model, session_dir=str(tmp_path_factory.mktemp("sessions")))
    with TestClient(create_app(config)) as test_client:
        yield test_client


def create(client: TestClient | httpx.Client) -> str:
    response = client.post("/v1/sessions", json={})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "session" and body["num_tokens"] == 0 and body["id"].startswith("sess-")
    return body["id"]


def history(client: TestClient, session_id: str) -> list[int]:
    """The session's tokens, read from its exported file."""
    response = client.get(f"/v1/sessions/{session_id}/state")
    assert response.status_code == 200 and response.headers["content-type"] == "application/octet-stream"
    tensors = safetensors.torch.load(response.content)
    return tensors["token_ids"].tolist() + tensors["pending_token_ids"].tolist()


def sse_chunks(text: str) -> list[dict[str, Any]]:
    events = [line.removeprefix("data: ") for line in text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", text
    return [json.loads(event) for event in events[:-1]]


def complete(client: TestClient, prompt: str | list[int], stream: bool = False, **fields: Any) -> dict[str, Any]:
    """Text, sampled-token logprobs and usage of one completion (streamed chunks joined)."""
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True, "logprobs": 0, **fields}
    if stream:
        body["stream_options"] = {"include_usage": True}
    response = client.post("/v1/completions", json={**body, "stream": stream})
    assert response.status_code == 200, response.text
    if not stream:
        choice = response.json()["choices"][0]
        return {"text": choice["text"], "logprobs": choice["logprobs"]["token_logprobs"], **response.json()["usage"]}
    chunks = sse_chunks(response.text)
    assert all("error" not in chunk for chunk in chunks), chunks
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    return {
        "text": "".join(c["text"] for c in choices),
        "logprobs": [lp for c in choices for lp in c["logprobs"]["token_logprobs"]],
        **chunks[-1]["usage"],
    }


def assert_same_output(got: dict[str, Any], want: dict[str, Any]) -> None:
    """The same tokens; logprobs equal up to float rounding (a state prefilled in chunks or decoded token by
    token differs in the last bits)."""
    assert got["text"] == want["text"]
    assert got["logprobs"] == pytest.approx(want["logprobs"], abs=1e-4)


def encode(prompt: str | list[int]) -> list[int]:
    return [int(word) for word in prompt.split()] if isinstance(prompt, str) else prompt


def error(response: httpx.Response) -> tuple[int, str | None]:
    return response.status_code, response.json()["error"]["code"]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_continuation_equals_sending_the_whole_history(
    client: TestClient, sampling: dict[str, Any], stream: bool
) -> None:
    session = create(client)
    before: list[int] = []
    for turn in TURNS:
        got = complete(client, turn, stream, session_id=session, **sampling)
        whole = before + encode(turn)
        want = complete(client, whole, **sampling)
        assert_same_output(got, want)
        assert got["prompt_tokens"] == len(whole) and got["completion_tokens"] == MAX_TOKENS
        # the history's last sampled token is fed with the new prompt: everything before it came from the state
        assert got["prompt_tokens_details"] == {"cached_tokens": max(len(before) - 1, 0)}
        after = history(client, session)
        assert after[: len(whole)] == whole and len(after) == len(whole) + MAX_TOKENS
        before = after
    assert client.get(f"/v1/sessions/{session}").json()["num_tokens"] == len(before)


@pytest.mark.parametrize("empty", ["", []], ids=["text", "token ids"])
def test_an_empty_prompt_continues_the_previous_answer(client: TestClient, empty: str | list[int]) -> None:
    """As text or as token ids (``[]`` was a 400 "prompt is empty")."""
    session = create(client)
    complete(client, " 5 6", session_id=session, **GREEDY)
    before = history(client, session)
    got = complete(client, empty, session_id=session, **SEEDED)
    assert_same_output(got, complete(client, before, **SEEDED))
    assert got["prompt_tokens"] == len(before) and history(client, session)[: len(before)] == before


def chat(client: TestClient, messages: list[dict[str, str]], **fields: Any) -> str:
    body = {"messages": messages, "max_tokens": MAX_TOKENS, **SEEDED, **fields}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


@pytest.mark.parametrize("system", [False, True], ids=["user", "system+user"])
def test_chat_continuation_renders_only_the_new_messages(client: TestClient, system: bool) -> None:
    """The first turn renders the messages as usual (' 1 7 8 2 3'); a later one what the template puts after
    the assistant's reply: its end (' 2'), the new messages (' 1 9 2') and the generation prompt (' 3')."""
    session = create(client)
    first = [{"role": "system", "content": " 50"}] * system + [{"role": "user", "content": " 7 8"}]
    reply = chat(client, first, session_id=session)
    before = history(client, session)
    assert before == encode(" 4 50 2" * system + " 1 7 8 2 3") + encode(reply) and reply == chat(client, first)
    second = chat(client, [{"role": "user", "content": " 9"}], session_id=session)
    whole = before + encode(" 2 1 9 2 3")
    assert history(client, session) == whole + encode(second)
    assert second == complete(client, whole, **SEEDED)["text"]
    turns = [*first, {"role": "assistant", "content": reply}, {"role": "user", "content": " 9"}]
    assert second == chat(client, turns)


def test_fork_branches_continue_independently(client: TestClient) -> None:
    session = create(client)
    for turn in TURNS[:2]:
        complete(client, turn, session_id=session, **GREEDY)
    shared = history(client, session)
    fork = client.post(f"/v1/sessions/{session}/fork", json={})
    assert fork.status_code == 200 and fork.json()["num_tokens"] == len(shared) and fork.json()["id"] != session
    branch = fork.json()["id"]
    assert history(client, branch) == shared
    for session_id, turn in [(session, [1, 2, 3]), (branch, " 40 41"), (session, " 8"), (branch, [9])]:
        before = history(client, session_id)
        got = complete(client, turn, session_id=session_id, **SEEDED)
        want = complete(client, before + encode(turn), **SEEDED)
        assert_same_output(got, want)
    assert history(client, session)[: len(shared)] == history(client, branch)[: len(shared)] == shared
    assert history(client, session)[len(shared)] == 1 and history(client, branch)[len(shared)] == 40


def test_export_on_one_replica_and_import_on_another(
    client: TestClient, token_id_model: dict[str, Any], tmp_path: Path
) -> None:
    session = create(client)
    for turn in TURNS[:2]:
        complete(client, turn, session_id=session, **GREEDY)
    state = client.get(f"/v1/sessions/{session}/state").content
    with TestClient(create_app(tiny_config(**token_id_model, session_dir=str(tmp_path)))) as replica:
        imported = replica.put(f"/v1/sessions/{session}/state", content=state, headers=STATE)
        assert imported.status_code == 201 and imported.json()["num_tokens"] == len(history(client, session))
        assert replica.put(f"/v1/sessions/{session}/state", content=state, headers=STATE).status_code == 200
        here = complete(client, TURNS[2], session_id=session, **SEEDED)
        there = complete(replica, TURNS[2], session_id=session, **SEEDED)
        assert here["text"] == there["text"] and here["logprobs"] == there["logprobs"]  # the same computation
        assert history(client, session) == history(replica, session)


def test_a_foreign_state_is_refused_and_changes_nothing(client: TestClient, tmp_path: Path) -> None:
    other_model = tiny_config(model="random:mamba-tiny", session_dir=str(tmp_path))
    with TestClient(create_app(other_model)) as other:
        foreign = create(other)
        complete(other, "Hi", session_id=foreign, **GREEDY)
        state = other.get(f"/v1/sessions/{foreign}/state").content
    session = create(client)
    complete(client, " 5 6", session_id=session, **GREEDY)
    before = history(client, session)
    refused = client.put(f"/v1/sessions/{session}/state", content=state, headers=STATE)
    assert error(refused) == (422, "session_model_mismatch") and "another model" in refused.json()["error"]["message"]
    assert error(client.put(f"/v1/sessions/{foreign}/state", content=state, headers=STATE))[0] == 422
    assert error(client.get(f"/v1/sessions/{foreign}"))[0] == 404
    assert history(client, session) == before
    assert complete(client, " 7", session_id=session, **GREEDY)["prompt_tokens"] == len(before) + 1


def test_a_damaged_file_is_a_422_and_other_sessions_still_work(client: TestClient) -> None:
    store = client.app.state.sessions  # type: ignore[attr-defined]
    truncated, garbage, intact = create(client), create(client), create(client)
    for session in (truncated, garbage, intact):
        complete(client, " 5 6", session_id=session, **GREEDY)
    path = store.path(truncated)
    path.write_bytes(path.read_bytes()[:-10])
    store.path(garbage).write_bytes(b"\x00garbage" * 100)
    for session in (truncated, garbage):
        for response in [
            client.post("/v1/completions", json={"prompt": " 8", "session_id": session}),
            client.post(
                "/v1/chat/completions", json={"messages": [{"role": "user", "content": " 8"}], "session_id": session}
            ),
            client.get(f"/v1/sessions/{session}"),
            client.get(f"/v1/sessions/{session}/state"),
            client.post(f"/v1/sessions/{session}/fork", json={}),
        ]:
            assert error(response) == (422, "session_corrupted"), response.text
    assert complete(client, " 7", session_id=intact, **GREEDY)["prompt_tokens"] == 2 + MAX_TOKENS + 1
    assert client.delete(f"/v1/sessions/{garbage}").json() == {"id": garbage, "object": "session", "deleted": True}
    assert error(client.get(f"/v1/sessions/{garbage}")) == (404, "session_not_found")


def test_session_requests_that_cannot_be_served_are_400s(client: TestClient) -> None:
    session = create(client)
    cases = [
        ({"prompt": "x", "n": 2}, "n"),
        ({"prompt": "x", "echo": True}, "echo"),
        ({"prompt": "x", "prompt_logprobs": 1}, "prompt_logprobs"),
        ({"prompt": ["a", "b"]}, "prompt"),
    ]
    for body, param in cases:
        response = client.post("/v1/completions", json={**body, "session_id": session})
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
    assert client.get(f"/v1/sessions/{session}").json()["num_tokens"] == 0
    empty = client.post("/v1/completions", json={"prompt": "", "session_id": session})
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "prompt"


def test_ids_cannot_reach_outside_the_session_folder(client: TestClient) -> None:
    create(client)
    folder = client.app.state.sessions.directory  # type: ignore[attr-defined]
    before = sorted(p.name for p in folder.parent.iterdir()), sorted(p.name for p in folder.iterdir())
    for bad in [
        "..%2F..%2Fescape",
        "sess-..%2F..%2Fescape0000000000",
        "sess-short",
        "..",
        "sess-%00aaaaaaaaaaaaaaaaaa",
    ]:
        for response in [
            client.get(f"/v1/sessions/{bad}"),
            client.delete(f"/v1/sessions/{bad}"),
            client.get(f"/v1/sessions/{bad}/state"),
            client.put(f"/v1/sessions/{bad}/state", content=b"x", headers=STATE),
            client.post(f"/v1/sessions/{bad}/fork", json={}),
        ]:
            assert response.status_code in (400, 404) and "error" in response.json(), (bad, response.text)
    response = client.post("/v1/completions", json={"prompt": "x", "session_id": "../../etc/passwd"})
    assert error(response) == (400, "invalid_session_id") and response.json()["error"]["param"] == "session_id"
    assert error(client.post("/v1/completions", json={"prompt": "x", "session_id": "sess-" + "a" * 30})) == (
        404,
        "session_not_found",
    )
    assert (sorted(p.name for p in folder.parent.iterdir()), sorted(p.name for p in folder.iterdir())) == before


def test_state_upload_checks_media_type_and_its_own_size_limit(client: TestClient) -> None:
    session = create(client)
    state = client.get(f"/v1/sessions/{session}/state").content
    assert error(client.put(f"/v1/sessions/{session}/state", content=state))[0] == 415
    engine = client.app.state.engine.engine  # type: ignore[attr-defined]
    over = 2 * engine.pool.bytes_per_slot + 8 * engine.max_model_len + (1 << 20) + 1
    too_big = client.put(f"/v1/sessions/{session}/state", content=b"\0" * over, headers=STATE)
    assert error(too_big) == (413, "request_too_large")
    assert client.put(f"/v1/sessions/{session}/state", content=b"\0" * 9000, headers=STATE).status_code == 422
    assert error(client.post("/v1/completions", json={"prompt": "x" * 9000}))[0] == 413


def test_limits_on_count(tmp_path: Path) -> None:
    with TestClient(create_app(tiny_config(max_sessions=2, session_dir=str(tmp_path)))) as limited:
        first, _ = create(limited), create(limited)
        refused = limited.post("/v1/sessions", json={})
        assert (
            error(refused) == (429, "session_limit_reached") and "--max-sessions" in refused.json()["error"]["message"]
        )
        assert error(limited.post(f"/v1/sessions/{first}/fork", json={}))[0] == 429
        limited.delete(f"/v1/sessions/{first}")
        assert limited.post("/v1/sessions", json={}).status_code == 200


def test_no_sessions_turns_the_routes_off() -> None:
    with TestClient(create_app(tiny_config(sessions=False))) as off:
        for response in [
            off.post("/v1/sessions", json={}),
            off.get("/v1/sessions/sess-" + "a" * 30),
            off.get("/v1/sessions/sess-" + "a" * 30 + "/state"),
        ]:
            assert error(response) == (404, "sessions_disabled")
        response = off.post("/v1/completions", json={"prompt": "x", "session_id": "sess-" + "a" * 30})
        assert error(response) == (400, "sessions_disabled") and response.json()["error"]["param"] == "session_id"
        assert off.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200


def test_one_request_at_a_time_and_an_aborted_turn_changes_nothing(tmp_path: Path) -> None:
    app = create_app(tiny_config(session_dir=str(tmp_path), max_prompt_tokens=None))
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=30) as http:
        session = create(http)
        assert (
            http.post("/v1/completions", json={"prompt": "Hi", "session_id": session, "max_tokens": 3}).status_code
            == 200
        )
        state = http.get(f"/v1/sessions/{session}/state").content
        long = {"prompt": "go", "session_id": session, "max_tokens": 100_000, "ignore_eos": True, "stream": True}
        with http.stream("POST", "/v1/completions", json=long) as streaming:
            assert streaming.status_code == 200
            lines = streaming.iter_lines()  # kept: a dropped iterator would close the connection
            assert next(lines).startswith("data: ")
            busy = http.post("/v1/completions", json={"prompt": "x", "session_id": session})
            assert error(busy) == (409, "session_busy")
            assert error(http.delete(f"/v1/sessions/{session}")) == (409, "session_busy")
            for upload in (state, b"garbage"):  # busy before the file is looked at, as any write
                assert error(http.put(f"/v1/sessions/{session}/state", content=upload, headers=STATE)) == (
                    409,
                    "session_busy",
                )
            assert http.post(f"/v1/sessions/{session}/fork", json={}).status_code == 200  # reads the stored state
        deadline = time.monotonic() + 10
        while True:  # the server lets the session go once it has seen the client leave
            response = http.post("/v1/completions", json={"prompt": "x", "session_id": session, "max_tokens": 1})
            if response.status_code != 409 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert response.status_code == 200, response.text
        # the aborted turn left no trace: the session went on from the state before it
        assert http.get(f"/v1/sessions/{session}/state").content != state
        assert response.json()["usage"]["prompt_tokens"] == sum(len(t) for t in tokens_of(state)) + 1


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_turn_the_engine_ends_as_aborted_is_a_503_and_keeps_the_state(
    client: TestClient, monkeypatch: pytest.MonkeyPatch, stream: bool
) -> None:
    """A session request the engine ends as aborted (e.g. a shutdown's drain) has no state to store: the client
    gets the 503 of a request cut by a shutdown, and the session its state from before the request."""
    session = create(client)
    complete(client, [5, 6], session_id=session)
    state = client.get(f"/v1/sessions/{session}/state").content
    route = AsyncEngine._route

    def route_as_aborted(engine: AsyncEngine, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            if out.finished:
                out.final_state = None
                for sample in out.outputs:
                    sample.finish_reason = "abort"
        route(engine, outputs)

    monkeypatch.setattr(AsyncEngine, "_route", route_as_aborted)
    body = {"prompt": [7], "session_id": session, "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": stream}
    response = client.post("/v1/completions", json=body)
    monkeypatch.undo()
    if stream:
        assert response.status_code == 200
        failure = sse_chunks(response.text)[-1]
    else:
        assert response.status_code == 503, response.text
        failure = response.json()
    assert failure["error"]["type"] == "service_unavailable", failure
    assert client.get(f"/v1/sessions/{session}/state").content == state
    complete(client, [7], session_id=session)  # the session was given back


def tokens_of(state: bytes) -> list[list[int]]:
    tensors = safetensors.torch.load(state)
    return [tensors["token_ids"].tolist(), tensors["pending_token_ids"].tolist()]


def test_session_flags() -> None:
    parser = argparse.ArgumentParser()
    ServerConfig.add_arguments(parser)
    defaults = ServerConfig.from_args(parser.parse_args([]))
    assert defaults.sessions and defaults.session_dir is None and defaults.max_sessions == 10000
    assert (defaults.max_session_bytes, defaults.session_cache_bytes) == (10 << 30, 256 << 20)
    flags = ["--no-sessions", "--session-dir", "/srv/s", "--max-sessions", "3", "--max-session-bytes", "1MiB"]
    config = ServerConfig.from_args(parser.parse_args([*flags, "--session-cache-bytes", "0"]))
    assert not config.sessions and config.session_dir == "/srv/s" and config.max_sessions == 3
    assert (config.max_session_bytes, config.session_cache_bytes) == (1 << 20, 0)
    assert defaults.session_ttl is None
    assert ServerConfig.from_args(parser.parse_args(["--session-ttl", "3600"])).session_ttl == 3600
    for ttl in ("0", "-1", "inf", "nan"):
        with pytest.raises(ValueError, match="--session-ttl"):
            ServerConfig.from_args(parser.parse_args(["--session-ttl", ttl]))


def session_metrics(client: TestClient) -> dict[str, float]:
    """The ``rnnserve_session*`` samples of the server's /metrics page, by name and labels but model_name."""
    found = {}
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("rnnserve_session") and "_created" not in line:
            name, value = line.rsplit(" ", 1)
            found[re.sub(r'model_name="[^"]*",?', "", name).replace("{}", "")] = float(value)
    return found


def test_session_metrics_follow_what_the_sessions_do(tmp_path: Path) -> None:
    config = tiny_config(session_dir=str(tmp_path), max_sessions=4, session_cache_bytes=1 << 20)
    with TestClient(create_app(config)) as client:
        before = session_metrics(client)
        assert before["rnnserve_sessions"] == 0 and before["rnnserve_session_turns_total"] == 0
        assert (before["rnnserve_sessions_limit"], before["rnnserve_session_cache_memory_total_bytes"]) == (4, 1 << 20)
        session = create(client)
        for prompt in ("Hi", " there"):  # the LRU holds what the server wrote
            assert complete(client, prompt, session_id=session)
        state = client.get(f"/v1/sessions/{session}/state").content
        imported, copied = "sess-" + "i" * 30, "sess-" + "c" * 30
        assert client.put(f"/v1/sessions/{imported}/state", content=state, headers=STATE).status_code == 201
        (tmp_path / f"{copied}.safetensors").write_bytes(state)  # copied in: its first turn reads the disk
        assert complete(client, " again", session_id=copied)
        fork = client.post(f"/v1/sessions/{session}/fork", json={}).json()["id"]
        assert error(client.post("/v1/sessions", json={})) == (429, "session_limit_reached")
        during = session_metrics(client)
        assert client.delete(f"/v1/sessions/{fork}").status_code == 200
        after = session_metrics(client)
    assert during["rnnserve_sessions"] == 4 and during["rnnserve_session_bytes"] > after["rnnserve_session_bytes"]
    assert after["rnnserve_sessions"] == 3
    assert after["rnnserve_session_bytes"] == sum(f.stat().st_size for f in tmp_path.glob("*.safetensors"))
    assert after["rnnserve_session_turns_total"] == 3 and after["rnnserve_session_rejected_total"] == 1
    operations = {op: after[f'rnnserve_session_operations_total{{operation="{op}"}}'] for op in
                  ("create", "fork", "import", "export", "delete")}  # fmt: skip
    assert operations == {"create": 1, "fork": 1, "import": 1, "export": 1, "delete": 1}
    # three turns and a fork loaded a session, all but the copied one's turn from the LRU
    assert (after["rnnserve_session_cache_queries_total"], after["rnnserve_session_cache_hits_total"]) == (4, 3)
    assert 0 < after["rnnserve_session_cache_memory_used_bytes"] <= 1 << 20
    assert after["rnnserve_session_expired_total"] == 0


def test_a_session_idle_for_the_ttl_expires(tmp_path: Path) -> None:
    """With --session-ttl, a session whose file was last used that long ago is gone (a 404 when named, deleted by
    the sweep otherwise); one used since is kept."""
    with TestClient(create_app(tiny_config(session_dir=str(tmp_path), session_ttl=3600))) as client:
        named, swept, kept = create(client), create(client), create(client)
        old = time.time() - 3600
        for session in (named, swept):
            os.utime(tmp_path / f"{session}.safetensors", (old, old))
        assert error(client.get(f"/v1/sessions/{named}")) == (404, "session_not_found")
        body = {"prompt": "Hi", "max_tokens": 2, "session_id": named}
        assert error(client.post("/v1/completions", json=body)) == (404, "session_not_found")
        assert client.app.state.sessions.expire_idle() == 1  # type: ignore[attr-defined]
        assert [f.name for f in tmp_path.glob("*.safetensors")] == [f"{kept}.safetensors"]
        assert client.get(f"/v1/sessions/{kept}").status_code == 200
        metrics = session_metrics(client)
    assert metrics["rnnserve_session_expired_total"] == 2 and metrics["rnnserve_sessions"] == 1
    os.utime(tmp_path / f"{kept}.safetensors", (old, old))
    with TestClient(create_app(tiny_config(session_dir=str(tmp_path), session_ttl=3600))):
        deadline = time.monotonic() + 30  # the server's sweep runs at start-up, off the event loop
        while (tmp_path / f"{kept}.safetensors").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not (tmp_path / f"{kept}.safetensors").exists()


def test_a_turn_past_the_length_limit_is_told_its_history_counts(tmp_path: Path) -> None:
    """A session that filled max_model_len gets a 400 for its next turn, which names the history with the prompt
    (a one-token turn was told its prompt had the whole history's length)."""
    config = tiny_config(session_dir=str(tmp_path), max_model_len=24, max_prompt_tokens=None)
    with TestClient(create_app(config)) as client:
        session = create(client)
        body = {"prompt": "abcdefghij", "session_id": session, "ignore_eos": True}  # the default max_tokens fills it
        assert client.post("/v1/completions", json=body).json()["usage"]["total_tokens"] == 24
        for prompt, max_tokens, param in [("", None, "prompt"), ("", 2, "max_tokens"), ("x", None, "prompt")]:
            body = {"prompt": prompt, "session_id": session, "max_tokens": max_tokens}
            response = client.post("/v1/completions", json=body)
            assert error(response)[0] == 400 and response.json()["error"]["param"] == param
            assert "context + prompt" in response.json()["error"]["message"], response.text
