"""Against a real server process: hostile sampling parameters get a 400 in OpenAI's format before they reach
the engine, while a stream that is already running finishes normally."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.server.conftest import TINY
from tests.server.server_process import running_server

pytestmark = pytest.mark.timeout(180)

BIG = str(10**400)  # overflows float(); as plain JSON digits it parses as an int
COMPLETION = '{"prompt": "x", "temperature": 1.0, '
CHAT = '{"messages": [{"role": "user", "content": "x"}], "logprobs": true, '
HOSTILE = [  # (body prefix, field = its parameter, raw JSON value)
    (COMPLETION, "top_k", BIG),
    (COMPLETION, "top_k", str(2**63)),
    (COMPLETION, "max_tokens", "1e300"),
    (COMPLETION, "max_tokens", str(2**64)),
    (COMPLETION, "max_tokens", "NaN"),
    (COMPLETION, "max_tokens", "true"),
    (COMPLETION, "n", "2.0"),
    (COMPLETION, "temperature", "Infinity"),
    (COMPLETION, "top_p", "NaN"),
    (COMPLETION, "frequency_penalty", BIG),
    (COMPLETION, "repetition_penalty", "1e-320"),
    (COMPLETION, "seed", str(2**64)),
    (COMPLETION, "stop_token_ids", f"[{2**64}]"),
    (COMPLETION, "logprobs", BIG),
    (COMPLETION, "logit_bias", f'{{"1": {BIG}}}'),
    (COMPLETION, "logit_bias", '{"1": 1e999}'),
    (COMPLETION, "logit_bias", f'{{"{BIG}": 1}}'),
    (COMPLETION, "allowed_token_ids", f"[{2**64}]"),
    (COMPLETION, "min_tokens", "-1"),
    (CHAT, "max_completion_tokens", BIG),
    (CHAT, "top_logprobs", str(2**63)),
]


def test_hostile_sampling_parameters_get_a_400_while_a_stream_finishes() -> None:
    with running_server("--model", TINY, "--max-num-seqs", "4") as server:
        body = {"prompt": "Hello", "max_tokens": 4000, "ignore_eos": True, "temperature": 1.0, "top_k": 50,
                "stream": True}  # fmt: skip
        chunks: list[dict] = []
        with httpx.Client(base_url=server.url, timeout=60) as client:
            with client.stream("POST", "/v1/completions", json=body) as stream:
                lines = (line[len("data: ") :] for line in stream.iter_lines() if line.startswith("data: "))
                chunks.append(json.loads(next(lines)))
                for prefix, param, value in HOSTILE:
                    path = "/v1/completions" if prefix == COMPLETION else "/v1/chat/completions"
                    hostile = f'{prefix}"{param}": {value}}}'
                    response = client.post(path, content=hostile, headers={"content-type": "application/json"})
                    assert response.status_code == 400, (hostile[:80], response.text)
                    error = response.json()["error"]
                    assert error["param"] == param and error["type"] == "invalid_request_error", error
                    assert error["message"]
                metrics = client.get("/metrics").text
                assert f'rnnserve_state_slots_used{{model_name="{TINY}"}} 1.0' in metrics  # still generating
                rest = list(lines)
            assert rest[-1] == "[DONE]"
            chunks += [json.loads(line) for line in rest[:-1]]
            assert all("error" not in chunk for chunk in chunks)
            finishes = [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices")]
            assert finishes[-1] == "length"
            assert client.get("/health").status_code == 200
