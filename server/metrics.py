"""Prometheus metrics of one server (names are a stable contract: dashboards depend on them).

Each server owns its own ``CollectorRegistry`` so several apps can live in one process (tests). See
``docs/metrics.md`` for meanings and units.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from rnnserve.engine.llm_engine import EngineLoad, StepStats
from rnnserve.engine.outputs import RequestOutput

LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    320.0,
)
TOKEN_LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 1024)


class ServerMetrics:
    """All metrics the server exports; updated from the engine thread (prometheus-client is thread-safe)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.num_requests_running = Gauge(
            "rnnserve_num_requests_running",
            "Sequences holding a state slot (prefilling or decoding).",
            registry=r,
        )
        self.num_requests_waiting = Gauge(
            "rnnserve_num_requests_waiting", "Requests queued for a free state slot.", registry=r
        )
        self.state_slots_used = Gauge("rnnserve_state_slots_used", "State slots in use.", registry=r)
        self.state_slots_total = Gauge("rnnserve_state_slots_total", "State slots in the pool.", registry=r)
        self.state_bytes_per_slot = Gauge(
            "rnnserve_state_bytes_per_slot", "Bytes of recurrent state per sequence.", registry=r
        )
        self.state_memory_used_bytes = Gauge(
            "rnnserve_state_memory_used_bytes", "Bytes of state held by running sequences.", registry=r
        )
        self.state_memory_total_bytes = Gauge(
            "rnnserve_state_memory_total_bytes", "Bytes of the preallocated state pool.", registry=r
        )
        self.prompt_tokens = Counter("rnnserve_prompt_tokens", "Prompt tokens prefilled.", registry=r)
        self.generation_tokens = Counter("rnnserve_generation_tokens", "Tokens generated.", registry=r)
        self.request_success = Counter(
            "rnnserve_request_success",
            "Finished requests by finish reason (stop, length, abort, error).",
            ["finished_reason"],
            registry=r,
        )
        self.time_to_first_token = Histogram(
            "rnnserve_time_to_first_token_seconds",
            "Arrival to first generated token.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.inter_token_latency = Histogram(
            "rnnserve_inter_token_latency_seconds",
            "Time between successive tokens of a request.",
            buckets=TOKEN_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e_request_latency = Histogram(
            "rnnserve_e2e_request_latency_seconds",
            "Arrival to finish of a request.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.request_queue_time = Histogram(
            "rnnserve_request_queue_time_seconds",
            "Arrival to admission into a state slot.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.engine_step = Histogram(
            "rnnserve_engine_step_seconds",
            "Duration of one engine step (prefill + decode + sampling).",
            buckets=TOKEN_LATENCY_BUCKETS,
            registry=r,
        )
        self.decode_batch_size = Histogram(
            "rnnserve_decode_batch_size",
            "Sequences decoded together in one engine step.",
            buckets=BATCH_SIZE_BUCKETS,
            registry=r,
        )
        for reason in ("stop", "length", "abort", "error"):
            self.request_success.labels(finished_reason=reason)

    def set_pool(self, num_slots: int, bytes_per_slot: int) -> None:
        self.state_slots_total.set(num_slots)
        self.state_bytes_per_slot.set(bytes_per_slot)
        self.state_memory_total_bytes.set(num_slots * bytes_per_slot)

    def set_load(self, load: EngineLoad) -> None:
        self.num_requests_running.set(load.num_running)
        self.num_requests_waiting.set(load.num_waiting)
        self.state_slots_used.set(load.slots_used)
        self.state_memory_used_bytes.set(load.slots_used * load.bytes_per_slot)

    def observe_step(self, stats: StepStats, outputs: list[RequestOutput]) -> None:
        """One engine step: its duration, batch and token counts, and its outputs' latencies."""
        self.engine_step.observe(stats.seconds)
        if stats.decode_batch_size:
            self.decode_batch_size.observe(stats.decode_batch_size)
        self.prompt_tokens.inc(stats.prefill_tokens)
        self.generation_tokens.inc(stats.generated_tokens)
        self.observe_outputs(outputs)

    def observe_outputs(self, outputs: list[RequestOutput]) -> None:
        """Latencies from the outputs' timestamps: queue time and TTFT at a request's first token, the
        inter-token latency at each later one, end-to-end latency and finish reason when it finishes."""
        for out in outputs:
            times = out.metrics
            if times.first_token_time is not None and any(s.new_token_ids for s in out.outputs):
                if times.previous_token_time is None:
                    self.time_to_first_token.observe(times.first_token_time - times.arrival_time)
                    if times.first_scheduled_time is not None:
                        self.request_queue_time.observe(times.first_scheduled_time - times.arrival_time)
                elif times.last_token_time is not None:
                    self.inter_token_latency.observe(times.last_token_time - times.previous_token_time)
            if out.finished:
                if times.finished_time is not None:
                    self.e2e_request_latency.observe(times.finished_time - times.arrival_time)
                reason = "error" if out.error is not None else out.outputs[0].finish_reason or "abort"
                self.request_success.labels(finished_reason=reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
