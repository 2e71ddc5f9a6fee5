"""The engine's request limits over HTTP, against a real ``rnnserve serve`` process: each is a 400 in OpenAI's
error format naming the field, and the server keeps serving."""

from __future__ import annotations

import httpx
import pytest

from tests.server.conftest import TINY
from tests.server.server_process import running_server

pytestmark = pytest.mark.timeout(180)

FLAGS = [
    "--model", TINY, "--max-num-seqs", "4", "--max-model-len", "256", "--max-stop-sequences", "4",
    "--max-stop-length", "32",
]  # fmt: skip
TOO_MUCH = [
    ({"prompt": "x" * 257}, "prompt"),
    ({"prompt": "x" * 200, "max_tokens": 57}, "max_tokens"),
    ({"prompt": "hello", "n": 4, "max_tokens": 10**12}, "max_tokens"),
    ({"prompt": "hello", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"prompt": "hello", "stop": ["s" * 33]}, "stop"),
    ({"prompt": [72, 105, 300]}, "prompt"),  # in the model's padded vocabulary (320), not the tokenizer's (257)
]


def test_limits_are_400s_naming_the_field() -> None:
    with running_server(*FLAGS) as server, httpx.Client(base_url=server.url, timeout=60) as http:
        for body, param in TOO_MUCH:
            response = http.post("/v1/completions", json={"max_tokens": 4, **body})
            assert response.status_code == 400, (body, response.text)
            assert response.json()["error"]["param"] == param, (body, response.text)
        ok = http.post("/v1/completions", json={"prompt": "x" * 200, "max_tokens": 56, "stop": ["s" * 32]})
        assert ok.status_code == 200 and ok.json()["usage"]["prompt_tokens"] == 200
