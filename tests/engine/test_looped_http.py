"""A looped transformer converted with ``rnnserve convert`` (no tokenizer) served over HTTP: token-id prompts,
a prompt past ``block_size`` is a clean 400 and the server keeps serving; generation ends with "length" at
``block_size``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from rnnserve.server.app import ServerConfig, create_app
from rnnserve.server.cli import main
from tests.engine.test_looped import MODEL_ARGS, authors_greedy, save_authors_checkpoint

BLOCK = MODEL_ARGS["block_size"]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[TestClient, dict]]:
    root = tmp_path_factory.mktemp("tmlt")
    sd = save_authors_checkpoint(root / "ckpt.pt", "tmlt")
    assert main(["convert", str(root / "ckpt.pt"), str(root / "native")]) == 0
    config = ServerConfig.build(model=str(root / "native"), device="cpu", max_num_seqs=2, api_key=None)
    with TestClient(create_app(config)) as client:
        yield client, sd


def test_token_id_prompts_match_the_authors_forward(served) -> None:
    client, sd = served
    prompt = [4, 90, 13, 13, 52]
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 0}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    expected = authors_greedy(sd, "tmlt", MODEL_ARGS, prompt, 6)
    assert response.json()["choices"][0]["text"] == "".join(f" {t}" for t in expected)
    as_text = client.post("/v1/completions", json={**body, "prompt": "4 90 13 13 52"})
    assert as_text.json()["choices"][0]["text"] == response.json()["choices"][0]["text"]
    streamed = client.post("/v1/completions", json={**body, "stream": True})
    events = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    assert "".join(e["choices"][0]["text"] for e in events) == response.json()["choices"][0]["text"]


def test_over_long_requests_are_400s_and_the_server_keeps_serving(served) -> None:
    client, _ = served
    too_long = [
        ({"prompt": list(range(BLOCK + 1)), "max_tokens": 1}, "prompt"),
        ({"prompt": list(range(BLOCK)), "max_tokens": 1}, "max_tokens"),
        ({"prompt": list(range(40)), "max_tokens": BLOCK - 39}, "max_tokens"),
        ({"prompt": "hello", "max_tokens": 1}, "prompt"),  # text, but this model has no tokenizer
    ]
    for body, param in too_long:
        response = client.post("/v1/completions", json={"temperature": 0, **body})
        assert response.status_code == 400, (body, response.text)
        assert response.json()["error"]["param"] == param, response.text
    full = client.post("/v1/completions", json={"prompt": list(range(40)), "max_tokens": BLOCK - 40, "temperature": 0})
    assert full.status_code == 200, full.text
    choice = full.json()["choices"][0]
    assert choice["finish_reason"] == "length" and full.json()["usage"]["total_tokens"] == BLOCK
    assert client.get("/health").status_code == 200


def test_convert_cli_refuses_a_non_looped_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "ckpt.pt").write_bytes(b"not a checkpoint")
    assert main(["convert", "--format", "looped", str(tmp_path / "ckpt.pt"), str(tmp_path / "out")]) == 1
    assert not (tmp_path / "out").exists()
