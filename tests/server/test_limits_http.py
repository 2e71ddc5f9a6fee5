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
    "--max-stop-length", "32", "--max-logprob-entries", "1000",
]  # fmt: skip
TOO_MUCH = [
    ({"prompt": "x" * 257}, "prompt"),
    ({"prompt": "x" * 200, "max_tokens": 57}, "max_tokens"),
    ({"prompt": "hello", "n": 4, "max_tokens": 10**12}, "max_tokens"),
    ({"prompt": "hello", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"prompt": "hello", "stop": ["s" * 33]}, "stop"),
    ({"prompt": [72, 105, 300]}, "prompt"),  # in the model's padded vocabulary (320), not the tokenizer's (257)
    # logprob entries: samples x tokens x (alternatives + 1), the prompts of a request together
    ({"prompt": "x" * 100, "prompt_logprobs": 20}, "prompt_logprobs"),  # 2100
    ({"prompt": "hello", "logprobs": 5, "max_tokens": 200}, "logprobs"),  # 1200
    ({"prompt": "x" * 100, "echo": True, "logprobs": 9, "max_tokens": 1}, "logprobs"),  # 1010
    ({"prompt": "x" * 51, "prompt_logprobs": 4, "n": 4}, "prompt_logprobs"),  # 4 samples x 255
    ({"prompt": ["x" * 50] * 4, "prompt_logprobs": 5}, "prompt_logprobs"),  # 4 prompts x 300
]


def test_limits_are_400s_naming_the_field() -> None:
    with running_server(*FLAGS) as server, httpx.Client(base_url=server.url, timeout=60) as http:
        for body, param in TOO_MUCH:
            response = http.post("/v1/completions", json={"max_tokens": 4, **body})
            assert response.status_code == 400, (body, response.text)
            assert response.json()["error"]["param"] == param, (body, response.text)
        ok = http.post("/v1/completions", json={"prompt": "x" * 200, "max_tokens": 56, "stop": ["s" * 32]})
        assert ok.status_code == 200 and ok.json()["usage"]["prompt_tokens"] == 200
        ok = http.post("/v1/completions", json={"prompt": ["x" * 50] * 3, "prompt_logprobs": 5, "max_tokens": 4})
        assert ok.status_code == 200 and len(ok.json()["choices"][2]["prompt_logprobs"]) == 50  # 900 entries
