"""A real server on 127.0.0.1: the official openai client, disconnects, metrics, queue-full 429."""

from __future__ import annotations

import asyncio
import json
import re
import time
from typing import Literal

import httpx
import openai
import pytest

from rnnserve.server.app import create_app
from rnnserve.server.background import serve_in_thread
from tests.server.conftest import API_KEY, TINY, tiny_config

pytestmark = pytest.mark.timeout(90)

AUTH = {"Authorization": f"Bearer {API_KEY}"}
LONG = {"prompt": "Hello", "max_tokens": 100_000, "ignore_eos": True, "stream": True}

METRIC_NAMES = [
    "rnnserve_num_requests_running", "rnnserve_num_requests_waiting", "rnnserve_state_slots_used",
    "rnnserve_state_slots", "rnnserve_state_bytes_per_slot", "rnnserve_state_memory_used_bytes",
    "rnnserve_state_memory_total_bytes", "rnnserve_prompt_tokens_total", "rnnserve_generation_tokens_total",
    'rnnserve_request_success_total{finished_reason="stop"}',
    'rnnserve_request_success_total{finished_reason="length"}',
    'rnnserve_request_success_total{finished_reason="abort"}',
    "rnnserve_time_to_first_token_seconds_count", "rnnserve_inter_token_latency_seconds_count",
    "rnnserve_e2e_request_latency_seconds_count", "rnnserve_request_queue_time_seconds_count",
    "rnnserve_engine_step_seconds_count", "rnnserve_decode_batch_size_count",
]  # fmt: skip


def scrape(url: str) -> dict[str, float]:
    text = re.sub(r',?model_name="[^"]*"', "", httpx.get(f"{url}/metrics", timeout=10).text).replace("{}", "")
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(rnnserve_\S+) (\S+)$", text, re.M)}


def wait_for(predicate, timeout: float = 10.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_official_openai_client(live_url: str) -> None:
    client = openai.OpenAI(base_url=f"{live_url}/v1", api_key=API_KEY, max_retries=0, timeout=30)
    assert [m.id for m in client.models.list()] == [TINY]
    completion = client.completions.create(model=TINY, prompt="Hello", max_tokens=5, temperature=0)
    assert completion.choices[0].finish_reason == "length" and completion.usage.completion_tokens == 5
    stream = client.completions.create(model=TINY, prompt="Hello", max_tokens=5, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == completion.choices[0].text
    chat = client.chat.completions.create(
        model=TINY, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0, seed=3
    )
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 4
    chunks = list(
        client.chat.completions.create(
            model=TINY, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0,
            stream=True, stream_options={"include_usage": True},
        )
    )  # fmt: skip
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 4
    extra = client.completions.create(
        model=TINY, prompt="Hello", max_tokens=4, extra_body={"top_k": 3, "min_tokens": 4, "ignore_eos": True}
    )
    assert extra.usage.completion_tokens == 4


def test_official_openai_client_structured_outputs_and_tool_calls(live_url: str) -> None:
    """The official client's own helpers: ``parse`` with a pydantic model (a strict ``json_schema`` response
    format), a forced function call read back as a ``tool_calls`` entry, and the streamed call accumulated by
    the client's stream helper."""
    from pydantic import BaseModel as Schema
    from pydantic import Field

    class Verdict(Schema):
        answer: Literal["yes", "no"]
        confidence: int = Field(ge=0, le=9)

    client = openai.OpenAI(base_url=f"{live_url}/v1", api_key=API_KEY, max_retries=0, timeout=30)
    messages = [{"role": "user", "content": "Is water wet?"}]
    parsed = client.chat.completions.parse(model=TINY, messages=messages, response_format=Verdict, max_tokens=60,
                                           temperature=1.0, seed=2)  # fmt: skip
    assert isinstance(parsed.choices[0].message.parsed, Verdict)
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer",
        "minimum": 1, "maximum": 7}}, "required": ["city", "days"], "additionalProperties": False}}}  # fmt: skip
    named = {"type": "function", "function": {"name": "get_weather"}}
    chat = client.chat.completions.create(model=TINY, messages=messages, tools=[weather], tool_choice=named,
                                          max_tokens=60, temperature=1.0, seed=5)  # fmt: skip
    [call] = chat.choices[0].message.tool_calls
    arguments = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and arguments["city"] in ("Paris", "Rome")
    with client.chat.completions.stream(model=TINY, messages=messages, tools=[weather], tool_choice=named,
                                        max_tokens=60, temperature=1.0, seed=5) as stream:  # fmt: skip
        final = stream.get_final_completion()
    assert json.loads(final.choices[0].message.tool_calls[0].function.arguments) == arguments


def test_official_openai_client_errors(live_url: str) -> None:
    client = openai.OpenAI(base_url=f"{live_url}/v1", api_key=API_KEY, max_retries=0, timeout=30)
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=TINY, prompt="x", max_tokens=-3)
    assert bad.value.body["param"] == "max_tokens"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-17", prompt="x")
    wrong = openai.OpenAI(base_url=f"{live_url}/v1", api_key="wrong", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()


def test_disconnect_mid_stream_frees_the_slot(live_url: str) -> None:
    before = scrape(live_url)
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", f"{live_url}/v1/completions", json=LONG, headers=AUTH) as response:
            lines = response.iter_lines()
            assert sum(1 for _, line in zip(range(6), lines, strict=False) if line.startswith("data:")) >= 2
            assert scrape(live_url)["rnnserve_state_slots_used"] == 1
    assert wait_for(lambda: scrape(live_url)["rnnserve_state_slots_used"] == 0)
    after = scrape(live_url)
    assert after['rnnserve_request_success_total{finished_reason="abort"}'] == (
        before['rnnserve_request_success_total{finished_reason="abort"}'] + 1
    )
    assert after["rnnserve_state_memory_used_bytes"] == 0


def test_disconnect_while_waiting_for_a_non_streaming_result_frees_the_slot(live_url: str) -> None:
    body = {**LONG, "stream": False}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{live_url}/v1/completions", json=body, headers=AUTH, timeout=1.0)
    assert wait_for(lambda: scrape(live_url)["rnnserve_state_slots_used"] == 0)


def test_metrics_are_present_and_move(live_url: str) -> None:
    before = scrape(live_url)
    assert [name for name in METRIC_NAMES if name not in before] == []
    assert before["rnnserve_state_slots"] == 2 and before["rnnserve_state_bytes_per_slot"] > 0
    assert before["rnnserve_state_memory_total_bytes"] == 2 * before["rnnserve_state_bytes_per_slot"]
    body = {"prompt": "Hello", "max_tokens": 5, "ignore_eos": True, "temperature": 0}
    assert httpx.post(f"{live_url}/v1/completions", json=body, headers=AUTH, timeout=30).status_code == 200
    after = scrape(live_url)
    assert after["rnnserve_prompt_tokens_total"] == before["rnnserve_prompt_tokens_total"] + 5
    assert after["rnnserve_generation_tokens_total"] == before["rnnserve_generation_tokens_total"] + 5
    length = 'rnnserve_request_success_total{finished_reason="length"}'
    assert after[length] == before[length] + 1
    for histogram, grew_by in (
        ("rnnserve_time_to_first_token_seconds", 1), ("rnnserve_inter_token_latency_seconds", 4),
        ("rnnserve_e2e_request_latency_seconds", 1), ("rnnserve_request_queue_time_seconds", 1),
    ):  # fmt: skip
        assert after[f"{histogram}_count"] == before[f"{histogram}_count"] + grew_by, histogram
    assert after["rnnserve_engine_step_seconds_count"] >= before["rnnserve_engine_step_seconds_count"] + 5
    assert after["rnnserve_decode_batch_size_count"] >= before["rnnserve_decode_batch_size_count"] + 4


def test_running_and_waiting_gauges_and_queue_full_429() -> None:
    app = create_app(tiny_config(max_num_seqs=1, max_waiting=1))

    async def scenario(url: str) -> None:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            async with http.stream("POST", "/v1/completions", json=LONG) as running:
                lines = running.aiter_lines()  # keep a reference: dropping it closes the connection
                await anext(lines)
                async with http.stream("POST", "/v1/completions", json=LONG) as waiting:
                    assert waiting.status_code == 200
                    metrics = await asyncio.to_thread(scrape, url)
                    assert metrics["rnnserve_num_requests_running"] == 1
                    assert metrics["rnnserve_num_requests_waiting"] == 1
                    full = await http.post("/v1/completions", json={"prompt": "x"})
                    assert full.status_code == 429 and int(full.headers["Retry-After"]) >= 1
                    assert full.json()["error"]["code"] == "queue_full"
        assert await asyncio.to_thread(wait_for, lambda: scrape(url)["rnnserve_state_slots_used"] == 0)
        assert scrape(url)["rnnserve_num_requests_waiting"] == 0

    with serve_in_thread(app) as url:
        asyncio.run(scenario(url))


def test_abort_frees_slots_before_the_next_engine_step() -> None:
    app = create_app(tiny_config())
    bridge = app.state.engine
    engine = bridge.engine
    steps: list[int] = []
    real_step = engine.step

    def counting_step(collect: bool = True):  # type: ignore[no-untyped-def]
        steps.append(engine.pool.num_used)
        return real_step(collect)

    engine.step = counting_step

    async def scenario() -> None:
        from rnnserve.engine.sampling_params import SamplingParams

        bridge.start(asyncio.get_running_loop())
        try:
            params = SamplingParams(max_tokens=100_000, ignore_eos=True, n=3)
            submission = await bridge.submit("cmpl-abort", ["Hello"], params)
            outputs = submission.outputs()
            await anext(outputs)
            assert engine.pool.num_used == 3
            submission.abort()
            aborted_at = len(steps)
            for _ in range(200):
                if engine.pool.num_used == 0:
                    break
                await asyncio.sleep(0.01)
            assert engine.pool.num_used == 0
            assert all(used == 0 for used in steps[aborted_at + 1 :])  # at most the in-flight step ran
        finally:
            await asyncio.to_thread(bridge.stop)

    asyncio.run(scenario())
