"""Sessions with a Hugging Face tokenizer: a tokenizer's automatic BOS begins the history once, and a chat
history that ends with the EOS token does not get the template's EOS text again."""

from __future__ import annotations

import time
from pathlib import Path

import safetensors.torch
from fastapi.testclient import TestClient

from rnnserve.engine.state_snapshot import StateSnapshot
from rnnserve.server.app import create_app
from tests.server.conftest import tiny_config
from tests.server.tiny_checkpoint import EOS, write_tiny_checkpoint

# ChatML-like: every message ends with the EOS text, as models whose turns end with their EOS token are templated.
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
GREEDY = {"temperature": 0, "max_tokens": 4}


def history(client: TestClient, session: str) -> list[int]:
    tensors = safetensors.torch.load(client.get(f"/v1/sessions/{session}/state").content)
    return tensors["token_ids"].tolist() + tensors["pending_token_ids"].tolist()


def tokenize(client: TestClient, text: str) -> list[int]:
    return client.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]


def test_the_bos_token_begins_the_history_once(tmp_path: Path) -> None:
    model = write_tiny_checkpoint(tmp_path / "model", bos_token=EOS, add_bos_token=True)
    with TestClient(create_app(tiny_config(model=str(model), session_dir=str(tmp_path / "s")))) as client:
        bos = client.get("/tokenizer_info").json()["bos_token_id"]
        session = client.post("/v1/sessions", json={}).json()["id"]
        client.post("/v1/completions", json={"prompt": "The fox", "session_id": session, **GREEDY})
        first = history(client, session)
        assert first[: 1 + len(tokenize(client, "The fox"))] == [bos, *tokenize(client, "The fox")]
        second = client.post("/v1/completions", json={"prompt": " jumps", "session_id": session, **GREEDY})
        assert second.json()["usage"]["prompt_tokens"] == len(first) + len(tokenize(client, " jumps"))
        assert history(client, session)[len(first) :][: len(tokenize(client, " jumps"))] == tokenize(client, " jumps")


def test_a_history_ending_with_eos_does_not_get_the_eos_text_again(tmp_path: Path) -> None:
    model = write_tiny_checkpoint(tmp_path / "model", chat_template=TEMPLATE)
    with TestClient(create_app(tiny_config(model=str(model), session_dir=str(tmp_path / "s")))) as client:
        eos = client.get("/tokenizer_info").json()["eos_token_id"]
        store = client.app.state.sessions  # type: ignore[attr-defined]
        session = client.post("/v1/sessions", json={}).json()["id"]
        messages = [{"role": "user", "content": "Hi"}]
        client.post("/v1/chat/completions", json={"messages": messages, "session_id": session, **GREEDY})
        stored = store.load(session).snapshot
        for ended_with_eos in (False, True):
            # the reply as the model would have ended it: with its EOS token, or cut by max_tokens
            reply = [*stored.token_ids, *stored.pending_token_ids] + [eos] * ended_with_eos
            now = int(time.time())
            state = store.codec.encode(StateSnapshot(stored.tensors, reply[:-1], reply[-1:]), now, now)
            put = client.put(
                f"/v1/sessions/{session}/state", content=state, headers={"Content-Type": "application/octet-stream"}
            )
            assert put.status_code == 200, put.text
            body = {"messages": [{"role": "user", "content": "More"}], "session_id": session, **GREEDY}
            assert client.post("/v1/chat/completions", json=body).status_code == 200
            added = tokenize(client, (EOS * (not ended_with_eos)) + "\nuser: More" + EOS + "\nassistant:")
            assert history(client, session)[len(reply) :][: len(added)] == added
