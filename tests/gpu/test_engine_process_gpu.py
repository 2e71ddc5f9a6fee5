"""The server on CUDA, where its engine runs in a process of its own by default: the same streamed and whole
answers as with the engine in a thread of the server (CUDA graphs and async scheduling on in both)."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(importlib.util.find_spec("fastapi") is None, reason="needs fastapi (the server)"),
]

BODIES = [
    {"prompt": "Hello", "max_tokens": 24, "temperature": 0, "ignore_eos": True},
    {"prompt": [3, 4, 5], "max_tokens": 16, "temperature": 0.9, "seed": 11, "n": 2, "logprobs": 2},
    {"prompt": ["a", "bb", "ccc"], "max_tokens": 12, "temperature": 0},
]


def answers(preset: str, engine_process: str) -> list[tuple[dict, dict[int, str]]]:
    from fastapi.testclient import TestClient

    from rnnserve.server.app import ServerConfig, create_app

    config = ServerConfig.build(model=f"random:{preset}", device="cuda", max_num_seqs=8, api_key=None,
                                engine_process=engine_process)  # fmt: skip
    assert config.uses_engine_process is (engine_process != "off")
    results = []
    with TestClient(create_app(config)) as client:
        for body in BODIES:
            whole = client.post("/v1/completions", json=body).json()
            assert "choices" in whole, whole
            streamed: dict[int, str] = {}
            response = client.post("/v1/completions", json={**body, "stream": True})
            for line in response.text.splitlines():
                if line.startswith("data: {"):
                    for choice in json.loads(line.removeprefix("data: "))["choices"]:
                        streamed[choice["index"]] = streamed.get(choice["index"], "") + choice["text"]
            results.append(({k: v for k, v in whole.items() if k not in ("id", "created")}, streamed))
    return results


@pytest.mark.parametrize("preset", ["mamba-tiny", "mamba2-tiny"])
def test_engine_process_answers_as_the_engine_thread_on_cuda(preset: str) -> None:
    in_process = answers(preset, "auto")
    assert in_process == answers(preset, "off")
    for whole, streamed in in_process:
        assert {c["index"]: c["text"] for c in whole["choices"]} == streamed
