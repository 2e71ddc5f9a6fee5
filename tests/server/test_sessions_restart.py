"""Sessions survive ``kill -9``: a real ``rnnserve serve`` process answers two turns, is killed with SIGKILL the
moment the second answer has arrived, and a restarted server continues the conversation exactly as a server
that never stopped does."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import safetensors.torch

from tests.server.conftest import TINY
from tests.server.server_process import running_server

pytestmark = pytest.mark.timeout(300)

TURNS = ["Once upon a time", " there was", " and then"]
SAMPLING = {"temperature": 0.9, "seed": 5, "max_tokens": 8, "ignore_eos": True}


def turn(http: httpx.Client, session: str, prompt: str, stream: bool) -> str:
    """One turn's text; a streamed turn is read to its ``[DONE]``."""
    body = {"prompt": prompt, "session_id": session, "stream": stream, **SAMPLING}
    if not stream:
        response = http.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["text"]
    text = ""
    with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line == "data: [DONE]":
                break
            if line.startswith("data: "):
                chunk: dict[str, Any] = json.loads(line.removeprefix("data: "))
                assert "error" not in chunk, chunk
                text += "".join(choice["text"] for choice in chunk["choices"])
    return text


def tokens(http: httpx.Client, session: str) -> list[int]:
    tensors = safetensors.torch.load(http.get(f"/v1/sessions/{session}/state").content)
    return tensors["token_ids"].tolist() + tensors["pending_token_ids"].tolist()


def test_kill_9_mid_conversation_then_continue(tmp_path: Path) -> None:
    flags = ("--model", TINY, "--max-num-seqs", "2", "--session-dir", str(tmp_path))
    with running_server(*flags) as first, httpx.Client(base_url=first.url, timeout=60) as http:
        session = http.post("/v1/sessions", json={}).json()["id"]
        before_kill = [turn(http, session, TURNS[0], stream=False), turn(http, session, TURNS[1], stream=True)]
        first.proc.kill()  # SIGKILL right after the streamed answer's end: its state must already be on disk
        first.proc.wait(timeout=30)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{session}.safetensors"]  # no half-written file
    with running_server(*flags) as second, httpx.Client(base_url=second.url, timeout=60) as http:
        assert http.get(f"/v1/sessions/{session}").json()["num_tokens"] == len(tokens(http, session))
        after_restart = turn(http, session, TURNS[2], stream=False)
        reference = http.post("/v1/sessions", json={}).json()["id"]
        uninterrupted = [turn(http, reference, prompt, stream=False) for prompt in TURNS]
        assert uninterrupted == [*before_kill, after_restart]
        assert tokens(http, session) == tokens(http, reference)
