"""vLLM-parity metrics: a model_name label on every series, per-request token, time and parameter histograms,
the 429 counter, process metrics, the state-usage ratio, and the periodic throughput log line."""

from __future__ import annotations

import asyncio
import logging
import random
import re
import time

import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from rnnserve.engine.llm_engine import EngineLoad, StepStats
from rnnserve.engine.outputs import TokenLatencies
from rnnserve.engine.prefix_cache import TierUsage
from rnnserve.engine.sampler import SampledTokens
from rnnserve.engine.scheduler import QueueFullError
from rnnserve.server.app import create_app
from rnnserve.server.http_server import build_server
from rnnserve.server.metrics import (
    TOKEN_LATENCY_BUCKETS,
    ServerMetrics,
    SharedStepHistogram,
    StatLogger,
    StepHistogram,
    token_buckets,
)
from tests.server.conftest import TINY, tiny_config

LABEL = f'model_name="{TINY}"'


def series(text: str) -> dict[str, float]:
    """``name{labels}`` -> value of every sample in a Prometheus text page."""
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(\w+(?:\{[^}]*\})?) (\S+)$", text, re.M)}


def value(samples: dict[str, float], name: str) -> float:
    return samples[f"{name}{{{LABEL}}}"]


def test_every_series_is_labelled_and_requests_are_measured() -> None:
    with TestClient(create_app(tiny_config(max_num_seqs=4))) as client:
        body = {"prompt": "Hello", "max_tokens": 5, "n": 2, "ignore_eos": True, "temperature": 1.0, "seed": 1}
        assert client.post("/v1/completions", json=body).status_code == 200
        text = client.get("/metrics").text
    samples = series(text)
    rnnserve = [name for name in samples if name.startswith("rnnserve_")]
    assert rnnserve and all(LABEL in name for name in rnnserve)
    assert value(samples, "rnnserve_request_prompt_tokens_sum") == 5  # b"Hello"
    assert value(samples, "rnnserve_request_prompt_tokens_count") == 1
    assert value(samples, "rnnserve_request_generation_tokens_sum") == 10  # both samples
    assert value(samples, "rnnserve_request_params_n_sum") == 2
    assert value(samples, "rnnserve_request_params_max_tokens_sum") == 5
    for name in ("prefill", "decode", "inference"):
        assert value(samples, f"rnnserve_request_{name}_time_seconds_count") == 1
    inference = value(samples, "rnnserve_request_inference_time_seconds_sum")
    parts = value(samples, "rnnserve_request_prefill_time_seconds_sum") + value(
        samples, "rnnserve_request_decode_time_seconds_sum"
    )
    assert 0 < parts <= inference
    assert value(samples, "rnnserve_state_usage_perc") == 0.0  # the request finished
    assert value(samples, "rnnserve_state_slots") == 4
    assert value(samples, "rnnserve_request_rejected_total") == 0
    assert samples["process_resident_memory_bytes"] > 0 and "process_cpu_seconds_total" in samples


def test_state_usage_follows_the_slots_in_use() -> None:
    app = create_app(tiny_config(max_num_seqs=4))
    bridge = app.state.engine
    with TestClient(app):
        bridge.metrics.set_load(EngineLoad(num_running=3, num_waiting=0, num_slots=4, slots_used=3, bytes_per_slot=8))
        assert value(series(bridge.metrics.render().decode()), "rnnserve_state_usage_perc") == 0.75


def test_the_load_gauges_show_the_latest_load_with_one_series_per_prefix_cache_tier() -> None:
    metrics = ServerMetrics(TINY, 64)
    tiers = [TierUsage("device", 10, 20, 3), TierUsage("host", 1, 2, 1)]
    metrics.set_load(EngineLoad(2, 1, 4, 2, 8, tiers))
    metrics.set_load(EngineLoad(3, 0, 4, 3, 8, tiers))
    text = metrics.render().decode()
    samples = series(text)
    expected = {"rnnserve_num_requests_running": 3, "rnnserve_num_requests_waiting": 0, "rnnserve_state_slots_used": 3,
                "rnnserve_state_usage_perc": 0.75, "rnnserve_state_memory_used_bytes": 24}  # fmt: skip
    assert {name: value(samples, name) for name in expected} == expected
    for tier, used, total, count in (("device", 10, 20, 3), ("host", 1, 2, 1)):
        labels = f'{{{LABEL},tier="{tier}"}}'
        assert samples[f"rnnserve_prefix_cache_memory_used_bytes{labels}"] == used
        assert samples[f"rnnserve_prefix_cache_memory_total_bytes{labels}"] == total
        assert samples[f"rnnserve_prefix_cache_snapshots{labels}"] == count
    assert "# TYPE rnnserve_prefix_cache_snapshots gauge" in text and "# TYPE rnnserve_state_slots_used gauge" in text
    metrics.set_load(EngineLoad(3, 0, 4, 3, 8, []))  # the cache off: the tier gauges are absent, not empty
    assert "rnnserve_prefix_cache_snapshots" not in metrics.render().decode()


def test_queue_full_answers_are_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    app = create_app(tiny_config())

    def full(*args: object, **kwargs: object) -> str:
        raise QueueFullError("256 requests are waiting")

    monkeypatch.setattr(app.state.engine.engine, "add_request", full)
    with TestClient(app) as client:
        for _ in range(2):
            assert client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1}).status_code == 429
        samples = series(client.get("/metrics").text)
    assert value(samples, "rnnserve_request_rejected_total") == 2
    assert value(samples, "rnnserve_request_params_n_count") == 0  # nothing was admitted


def test_token_buckets_end_at_max_model_len() -> None:
    assert token_buckets(300) == (1, 2, 5, 10, 20, 50, 100, 200, 300)
    assert token_buckets(200) == (1, 2, 5, 10, 20, 50, 100, 200)


def test_stat_logger_logs_throughput_every_interval_while_busy(caplog: pytest.LogCaptureFixture) -> None:
    load = EngineLoad(num_running=2, num_waiting=1, num_slots=8, slots_used=2, bytes_per_slot=1)
    stats = StatLogger(interval=10.0)
    caplog.set_level(logging.INFO, logger="rnnserve.metrics")
    assert stats.record(StepStats(prefill_tokens=100, generated_tokens=2, seconds=1.0), load, now=101.0) is None
    for t in range(102, 110):
        assert stats.record(StepStats(generated_tokens=2, seconds=1.0), load, now=float(t)) is None
    line = stats.record(StepStats(generated_tokens=2, seconds=1.0), load, now=110.0)
    assert line == (
        "Avg prompt throughput: 10.0 tokens/s, Avg generation throughput: 2.0 tokens/s, "
        "Running: 2 reqs, Waiting: 1 reqs, State usage: 25.0%"
    )
    assert caplog.messages == [line]
    # After an idle spell the interval restarts: the idle minutes do not dilute the next line's throughput.
    assert stats.record(StepStats(generated_tokens=4, seconds=1.0), load, now=500.0) is None
    line = stats.record(StepStats(generated_tokens=36, seconds=1.0), load, now=509.0)
    assert line is not None and "Avg generation throughput: 4.0 tokens/s" in line


def test_access_log_is_off_unless_asked() -> None:
    app = create_app(tiny_config())
    try:
        assert not build_server(app, tiny_config()).config.access_log
        assert build_server(app, tiny_config(access_log=True)).config.access_log
    finally:
        app.state.engine.stop()  # never served: no lifespan stops its engine


def test_step_histogram_exposes_what_a_prometheus_histogram_does() -> None:
    """The step histogram takes a step's latencies in one call; its page equals prometheus-client's histogram
    fed the same values one by one (bucket edges included), except the creation time and the sum's rounding."""
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    step = StepHistogram("x_seconds", "Doc.", TOKEN_LATENCY_BUCKETS, "m", ours)
    reference = Histogram("x_seconds", "Doc.", ["model_name"], buckets=TOKEN_LATENCY_BUCKETS, registry=theirs)
    rng = random.Random(0)
    values = [rng.choice([0.0, 0.0005, 0.001, 2.5, 3.0]) for _ in range(100)] + [rng.uniform(0, 3) for _ in range(900)]
    for start in range(0, len(values), 256):
        step.observe_many(values[start : start + 256])
    step.observe_many([])
    step.observe(0.02)
    for v in [*values, 0.02]:
        reference.labels(model_name="m").observe(v)
    got, want = series(generate_latest(ours).decode()), series(generate_latest(theirs).decode())
    assert got.keys() == want.keys()
    for name, expected in want.items():
        if "_created" not in name:
            assert got[name] == pytest.approx(expected, rel=1e-12), name
    assert got['x_seconds_bucket{le="+Inf",model_name="m"}'] == len(values) + 1


def test_shared_step_histogram_counts_a_batch_as_one_observe_per_value() -> None:
    """The API servers' shared histogram adds a step's values bucket by bucket: the same exposition as one
    ``observe`` per value (bounds themselves, zeros, values past the last bound, an empty batch)."""
    batched, one_by_one = CollectorRegistry(), CollectorRegistry()
    histograms = [Histogram("x_seconds", "Doc.", ["model_name"], buckets=TOKEN_LATENCY_BUCKETS, registry=r)
                  for r in (batched, one_by_one)]  # fmt: skip
    shared = SharedStepHistogram(histograms[0].labels(model_name="m"))
    rng = random.Random(1)
    values = [rng.choice([*TOKEN_LATENCY_BUCKETS, 0.0, 99.0]) for _ in range(300)]
    values += [rng.uniform(0, 3) for _ in range(700)]
    for start in range(0, len(values), 256):
        shared.observe_many(values[start : start + 256])
    shared.observe_many([])
    shared.observe(0.02)
    for v in [*values, 0.02]:
        histograms[1].labels(model_name="m").observe(v)
    got, want = series(generate_latest(batched).decode()), series(generate_latest(one_by_one).decode())
    assert got.keys() == want.keys()
    for name, expected in want.items():
        if "_created" not in name:
            assert got[name] == pytest.approx(expected, rel=1e-12), name


@pytest.mark.parametrize("shared", [False, True])
def test_a_steady_steps_latencies_as_one_value_and_a_count_give_the_page_of_the_list(shared: bool) -> None:
    """A steady step's inter-token latencies cross as one value and a count (``TokenLatencies.same_inter_token``):
    observed so, the page is the one of the list of them, sum included to the last bit, in the single-process
    histogram and in the API servers' shared one."""
    pages = []
    for repeated in (False, True):
        registry = CollectorRegistry()
        if shared:
            histogram = Histogram("x_seconds", "Doc.", ["model_name"], buckets=TOKEN_LATENCY_BUCKETS, registry=registry)
            observer: StepHistogram | SharedStepHistogram = SharedStepHistogram(histogram.labels(model_name="m"))
        else:
            observer = StepHistogram("x_seconds", "Doc.", TOKEN_LATENCY_BUCKETS, "m", registry)
        for value, count in [(0.0123456789, 256), (0.0005, 3), (0.1, 0), (7.0, 1), (0.0123456789, 255)]:
            if repeated:
                observer.observe_repeated(value, count)
            else:
                observer.observe_many([value] * count)
        pages.append({k: v for k, v in series(generate_latest(registry).decode()).items() if "_created" not in k})
    assert pages[0] == pages[1]


def test_a_steady_step_observes_its_inter_token_latencies() -> None:
    """``observe_step`` of a steady step's stats (one value and a count) gives the inter-token histogram of the
    same step with one entry per request."""
    pages = []
    for latencies in (TokenLatencies(inter_token=[0.02] * 200 + [0.5]),
                      TokenLatencies(inter_token=[0.5], same_inter_token=0.02, same_inter_token_count=200)):
        metrics = ServerMetrics(TINY, 2048)
        metrics.observe_step(StepStats(latencies=latencies))
        page = series(metrics.render().decode())
        pages.append({k: v for k, v in page.items() if k.startswith("rnnserve_inter_token_latency_seconds_")
                      and "_created" not in k})
    assert pages[0] == pages[1]
    assert pages[1][f"rnnserve_inter_token_latency_seconds_count{{{LABEL}}}"] == 201


def test_a_scrape_and_the_dashboards_sampler_collect_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """A collection reads /proc (the processes' series) and, with several API servers, the shared metrics' files:
    on the event loop it stalled every stream of the server for as long, and the dashboard's sampler collected
    there once a second."""
    app = create_app(tiny_config())
    registry = app.state.metrics.registry
    real_collect = registry.collect
    on_loop: list[bool] = []

    def collect():  # type: ignore[no-untyped-def]
        try:
            asyncio.get_running_loop()
            on_loop.append(True)
        except RuntimeError:
            on_loop.append(False)
        return real_collect()

    monkeypatch.setattr(registry, "collect", collect)
    with TestClient(app) as client:
        assert client.get("/metrics").status_code == 200
        deadline = time.monotonic() + 30
        while len(on_loop) < 2 and time.monotonic() < deadline:  # the sampler's first sample, and the scrape
            time.sleep(0.05)
    assert len(on_loop) >= 2 and not any(on_loop)


def test_the_engines_wait_for_the_device_is_a_counter_that_grows(monkeypatch: pytest.MonkeyPatch) -> None:
    """``rnnserve_engine_device_wait_seconds_total`` adds up the steps' waits for their sampled tokens: 0 on the CPU,
    where they are ready when sampled, and each step's wait where the device's event makes the host wait."""

    class WaitingEvent:
        def synchronize(self) -> None:
            time.sleep(0.002)

    name = f"rnnserve_engine_device_wait_seconds_total{{{LABEL}}}"
    body = {"prompt": "Hi", "max_tokens": 5, "ignore_eos": True}
    with TestClient(create_app(tiny_config())) as client:
        assert client.post("/v1/completions", json=body).status_code == 200
        assert series(client.get("/metrics").text)[name] == 0.0
        init = SampledTokens.__init__

        def with_event(self: SampledTokens, *args: object) -> None:
            init(self, *args)  # type: ignore[arg-type]
            self._ready = WaitingEvent()  # type: ignore[assignment]

        monkeypatch.setattr(SampledTokens, "__init__", with_event)
        assert client.post("/v1/completions", json=body).status_code == 200
        assert series(client.get("/metrics").text)[name] >= 5 * 0.002
