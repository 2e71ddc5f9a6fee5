"""``rnnserve bench``'s figures against a scripted server whose every byte arrives at a known time: a fake clock
stands for ``time.perf_counter`` and ``time.time``, and each scripted event sets it before the bench reads it,
so TTFT, ITL, TPOT, E2E latency and the throughputs are checked exactly against vLLM's definitions."""

from __future__ import annotations

import asyncio
import itertools
import json
import math
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import httpx
import pytest

from rnnserve.clients import bench
from rnnserve.clients.bench import BenchConfig, arrival_times, summarize
from rnnserve.server import cli

pytestmark = pytest.mark.timeout(60)


@dataclass
class FakeClock:
    now: float = 1000.0

    def __call__(self) -> float:
        return self.now


def token(text: str = "a", **fields: object) -> dict:
    return {"id": "cmpl-1", "object": "text_completion", "choices": [{"index": 0, "text": text, **fields}]}


def usage(prompt: int, completion: int) -> dict:
    return {"id": "cmpl-1", "object": "text_completion", "choices": [],
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion}}  # fmt: skip


def event(payload: dict | str) -> bytes:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n".encode()


@dataclass
class ScriptedServer:
    """Answers each ``/v1/completions`` with the next script: ``(seconds after the request, bytes)`` pairs, each
    written when the clock reads that time (several events in one pair arrive in one read); an
    ``httpx.Response`` instead of a script is answered as it is."""

    clock: FakeClock
    scripts: list[list[tuple[float, bytes]]]
    sent_at: list[float] = field(default_factory=list)

    def handler(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "fake"}]})
        self.sent_at.append(self.clock.now)
        script, start = self.scripts[len(self.sent_at) - 1], self.clock.now
        if isinstance(script, httpx.Response):
            return script

        async def body() -> AsyncIterator[bytes]:
            for at, data in script:
                self.clock.now = max(self.clock.now, start + at)  # streams that overlap never turn it back
                await asyncio.sleep(0)
                yield data

        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body())


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeClock]:
    fake = FakeClock()
    monkeypatch.setattr(bench.time, "perf_counter", fake)
    monkeypatch.setattr(bench.time, "time", fake)
    yield fake


def run(server: ScriptedServer, monkeypatch: pytest.MonkeyPatch, **config: object) -> dict:
    def client(config: BenchConfig, tls: object = None) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url="http://scripted", transport=httpx.MockTransport(server.handler))

    monkeypatch.setattr(bench, "http_client", client)
    settings = {"num_prompts": len(server.scripts), "concurrency": 1, "prompts": "ids", "progress": False,
                "input_len": 4, **config}  # fmt: skip
    return asyncio.run(bench.benchmark(BenchConfig(url="http://scripted", **settings)))  # type: ignore[arg-type]


def test_figures_follow_vllms_definitions_exactly(clock: FakeClock, monkeypatch: pytest.MonkeyPatch) -> None:
    """Request 1: tokens at 0.1, 0.3 (empty text: a token without text yet still counts), 0.4 (two tokens in one
    chunk), then usage at 0.9 and [DONE] at 1.0. Request 2: four tokens in one read at 0.2 with usage and
    [DONE]. The E2E latency (and so TPOT) ended at the stream's end, 1.0 s, where vLLM's ends at the last token
    chunk, 0.4 s: a server that sends its usage late looked slower per token than under vLLM's bench."""
    first = [(0.1, event(token())), (0.3, event(token(""))), (0.4, event(token("bc", finish_reason="length"))),
             (0.9, event(usage(4, 4))), (1.0, event("[DONE]"))]  # fmt: skip
    second = [(0.2, event(token("abcd")) + event(usage(4, 4)) + event("[DONE]"))]
    figures = run(ScriptedServer(clock, [first, second]), monkeypatch)
    assert figures["completed"] == 2 and figures["failed"] == 0
    assert figures["total_output_tokens"] == 8 and figures["total_chunks"] == 4
    assert figures["duration_s"] == pytest.approx(1.2)  # the second request starts when the first ends
    assert figures["request_throughput"] == pytest.approx(2 / 1.2)
    assert figures["output_throughput"] == pytest.approx(8 / 1.2)
    assert figures["total_token_throughput"] == pytest.approx(16 / 1.2)
    expected = {
        "ttft_ms": [100, 200],
        "itl_ms": [200, 100],  # gaps between chunks (first request only), whatever the tokens in each
        "tpot_ms": [(400 - 100) / 3, 0.0],  # (latency - ttft) / (output tokens - 1)
        "e2e_latency_ms": [400, 200],
    }
    for key, values in expected.items():
        values = sorted(values)
        assert figures[key]["mean"] == pytest.approx(sum(values) / 2), key
        assert figures[key]["p50"] == pytest.approx((values[0] + values[1]) / 2), key  # numpy's median
        assert figures[key]["p99"] == pytest.approx(values[0] + 0.99 * (values[1] - values[0])), key


def test_percentiles_interpolate_as_numpy_does() -> None:
    """Nearest-rank percentiles (p50 of [1, 2] = 1) are not what vLLM prints (numpy's linear interpolation)."""
    assert summarize([1.0, 2.0], scale=1.0) == {"mean": 1.5, "p50": 1.5, "p90": pytest.approx(1.9),
                                                "p99": pytest.approx(1.99)}  # fmt: skip
    stats = summarize([float(x) for x in range(1, 101)], scale=1.0)
    assert stats == {"mean": 50.5, "p50": 50.5, "p90": pytest.approx(90.1), "p99": pytest.approx(99.01)}
    assert summarize([7.0], scale=1.0) == {"mean": 7.0, "p50": 7.0, "p90": 7.0, "p99": 7.0}


def test_failures_mid_run_are_counted_not_dropped(clock: FakeClock, monkeypatch: pytest.MonkeyPatch) -> None:
    """An error event after tokens, an HTTP error, a stream of usage only and a stream cut before [DONE] each
    count as one failure; the figures describe the two requests that completed."""
    good = [(0.1, event(token())), (0.2, event(token()) + event(usage(4, 2)) + event("[DONE]"))]
    error_event = [(0.1, event(token())), (0.2, event({"error": {"message": "boom", "type": "internal_error"}})
                                           + event("[DONE]"))]  # fmt: skip
    refused = httpx.Response(503, json={"error": {"message": "shutting down", "type": "service_unavailable"}})
    only_usage = [(0.1, event(usage(4, 0)) + event("[DONE]"))]
    cut = [(0.1, event(token()))]
    scripts = [good, error_event, refused, only_usage, cut, good]
    figures = run(ScriptedServer(clock, scripts), monkeypatch)  # type: ignore[arg-type]
    assert figures["completed"] == 2 and figures["failed"] == 4 and sum(figures["failures"].values()) == 4
    assert figures["total_output_tokens"] == 4 and figures["e2e_latency_ms"]["mean"] == pytest.approx(200)
    assert figures["duration_s"] == pytest.approx(0.2 + 0.2 + 0 + 0.1 + 0.1 + 0.2)


def test_goodput_counts_the_requests_within_every_objective(
    clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TTFT 100/300 ms, TPOT 50/50 ms, E2E 150/350 ms: with ttft:200 tpot:100 only the first is good (vLLM's
    request goodput: good requests over the duration); with e2el:400 both are."""
    fast_start = [(0.1, event(token())), (0.15, event(token()) + event(usage(4, 2)) + event("[DONE]"))]
    slow_start = [(0.3, event(token())), (0.35, event(token()) + event(usage(4, 2)) + event("[DONE]"))]
    figures = run(ScriptedServer(clock, [fast_start, slow_start]), monkeypatch, goodput={"ttft": 200, "tpot": 100})
    assert figures["request_goodput"] == pytest.approx(1 / 0.5)
    assert "request goodput (req/s)" in bench.format_report(figures)
    figures = run(ScriptedServer(clock, [fast_start, slow_start]), monkeypatch, goodput={"e2el": 400})
    assert figures["request_goodput"] == pytest.approx(2 / 0.5)
    assert "request_goodput" not in run(ScriptedServer(clock, [fast_start]), monkeypatch)


def test_goodput_objectives_are_checked_on_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    for wrong in ("ttfb:100", "ttft", "ttft:-1"):
        with pytest.raises(SystemExit):
            cli.main(["bench", "--goodput", wrong])
        assert "--goodput" in capsys.readouterr().err


def test_arrivals_keep_to_their_schedule_when_the_loop_wakes_late(
    clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each wake-up comes 20 ms late (a loop busy parsing streams): gaps slept one after another added up the
    delays, so the 20th request went out 0.38 s late and the load arrived slower than --request-rate."""
    real_sleep = asyncio.sleep

    async def late_sleep(seconds: float) -> None:
        for _ in range(50):  # the requests sent before reach the server first
            await real_sleep(0)
        if seconds > 0:  # not the sleep(0) of a library's checkpoint
            clock.now += seconds + 0.02

    monkeypatch.setattr(bench.asyncio, "sleep", late_sleep)
    script = [(0.0, event(token()) + event(usage(4, 1)) + event("[DONE]"))]
    server = ScriptedServer(clock, [script] * 20)
    run(server, monkeypatch, concurrency=None, request_rate=10.0, seed=3)
    planned = arrival_times(20, 10.0, 1.0, bench.random.Random(3 + 1))
    lateness = [sent - server.sent_at[0] - at for sent, at in zip(server.sent_at, planned, strict=True)]
    assert max(lateness) <= 0.02 + 1e-9


@pytest.mark.parametrize("burstiness", [0.5, 1.0, 4.0, math.inf])
def test_arrival_schedule_has_the_asked_rate(burstiness: float) -> None:
    times = arrival_times(200, 20.0, burstiness, bench.random.Random(0))
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert times[0] == 0 and times[-1] == pytest.approx(199 / 20) and min(gaps) >= 0
    if math.isinf(burstiness):
        assert gaps == pytest.approx([1 / 20] * 199)
    else:  # a gamma's coefficient of variation is 1 / sqrt(shape): burstier below 1, more even above
        spread = (sum((g - 1 / 20) ** 2 for g in gaps) / len(gaps)) ** 0.5 * 20
        assert abs(spread - burstiness**-0.5) < 0.35 * burstiness**-0.5
    assert arrival_times(3, None, 1.0, bench.random.Random(0)) == [0.0, 0.0, 0.0]

