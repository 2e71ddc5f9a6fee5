"""The live dashboard: ``GET /dashboard`` (a static page, no external network) and ``GET /dashboard/stats``
(JSON time series computed from the server's own Prometheus registry).

A sampler reads the registry once a second while the app runs (in a thread: a collection reads files) and keeps
the last five minutes: throughput and error rates over the trailing ``RATE_WINDOW`` seconds, latency percentiles
over the trailing ``LATENCY_WINDOW`` seconds (interpolated in the histogram buckets as PromQL's
``histogram_quantile`` does), and the load gauges. A request costs a slice of that history; ``?since=T``
returns only the points after ``T``.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import APIRouter, FastAPI
from fastapi.responses import JSONResponse, Response

from rnnserve.server.errors import APIError
from rnnserve.server.metrics import ServerMetrics

STATIC = Path(__file__).parent / "static"
SAMPLE_INTERVAL = 1.0
HISTORY_POINTS = 300
RATE_WINDOW = 5.0
LATENCY_WINDOW = 30.0
QUANTILES = (0.5, 0.9, 0.99)

# The series the dashboard reads (the names tests/deploy checks against /metrics and the Grafana dashboard).
COUNTERS = {
    "generation_tps": "rnnserve_generation_tokens_total",
    "prompt_tps": "rnnserve_prompt_tokens_total",
    "requests_per_s": "rnnserve_request_success_total",
    "rejected_per_s": "rnnserve_request_rejected_total",
}
ERRORS = ("rnnserve_request_success_total", "error")
GAUGES = {
    "running": "rnnserve_num_requests_running",
    "waiting": "rnnserve_num_requests_waiting",
    "slots_used": "rnnserve_state_slots_used",
    "slots_total": "rnnserve_state_slots",
    "state_memory_used_bytes": "rnnserve_state_memory_used_bytes",
    "state_memory_total_bytes": "rnnserve_state_memory_total_bytes",
}
HISTOGRAMS = {
    "ttft": "rnnserve_time_to_first_token_seconds",
    "itl": "rnnserve_inter_token_latency_seconds",
    "e2e": "rnnserve_e2e_request_latency_seconds",
}


@dataclass
class Snapshot:
    """Cumulative values of the registry at one moment (counters summed over their labels)."""

    t: float
    counters: dict[str, float]
    errors: float
    gauges: dict[str, float]
    buckets: dict[str, list[tuple[float, float]]]  # metric -> [(le, cumulative count)], le ascending


def take_snapshot(metrics: ServerMetrics, now: float | None = None) -> Snapshot:
    """One pass over the registry's collectors."""
    wanted_counters = set(COUNTERS.values())
    wanted_gauges = set(GAUGES.values())
    bucket_names = {f"{name}_bucket": name for name in HISTOGRAMS.values()}
    counters = dict.fromkeys(wanted_counters, 0.0)
    gauges = dict.fromkeys(wanted_gauges, 0.0)
    buckets: dict[str, dict[float, float]] = {name: {} for name in HISTOGRAMS.values()}
    errors = 0.0
    for family in metrics.registry.collect():
        for sample in family.samples:
            if sample.name in wanted_counters:
                counters[sample.name] += sample.value
                if (sample.name, sample.labels.get("finished_reason")) == ERRORS:
                    errors += sample.value
            elif sample.name in wanted_gauges:
                gauges[sample.name] += sample.value
            elif sample.name in bucket_names:
                per_le = buckets[bucket_names[sample.name]]
                le = float(sample.labels["le"])
                per_le[le] = per_le.get(le, 0.0) + sample.value
    return Snapshot(
        t=time.time() if now is None else now,
        counters=counters,
        errors=errors,
        gauges=gauges,
        buckets={name: sorted(per_le.items()) for name, per_le in buckets.items()},
    )


def bucket_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """The q-quantile of observations counted in cumulative ``buckets`` (PromQL's ``histogram_quantile``:
    linear within a bucket, the highest finite bound when it falls in +Inf); None without observations."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if math.isinf(le):
                return lower
            if count == below:
                return le
            return lower + (le - lower) * (rank - below) / (count - below)
        lower, below = le, count
    return lower


def bucket_delta(new: list[tuple[float, float]], old: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Histogram bucket counts ``(le, count)`` of ``new`` minus those of ``old`` (the observations between them)."""
    previous = dict(old)
    return [(le, count - previous.get(le, 0.0)) for le, count in new]


def make_point(new: Snapshot, rate_base: Snapshot, latency_base: Snapshot) -> dict[str, Any]:
    """The dashboard's figures at ``new``: rates since ``rate_base``, percentiles since ``latency_base``."""
    elapsed = max(new.t - rate_base.t, 1e-9)
    point: dict[str, Any] = {"t": round(new.t, 3)}
    for key, name in COUNTERS.items():
        point[key] = round(max(new.counters[name] - rate_base.counters[name], 0.0) / elapsed, 3)
    point["errors_per_s"] = round(max(new.errors - rate_base.errors, 0.0) / elapsed, 3)
    for key, name in GAUGES.items():
        point[key] = new.gauges[name]
    for key, name in HISTOGRAMS.items():
        window = bucket_delta(new.buckets[name], latency_base.buckets[name])
        quantiles = {f"p{round(q * 100)}": bucket_quantile(q, window) for q in QUANTILES}
        point[key] = {p: None if v is None else round(v, 6) for p, v in quantiles.items()}
    return point


class StatsHistory:
    """The last ``HISTORY_POINTS`` snapshots and the points computed from them."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self.snapshots: deque[Snapshot] = deque(maxlen=HISTORY_POINTS + int(LATENCY_WINDOW / SAMPLE_INTERVAL) + 1)
        self.points: deque[dict[str, Any]] = deque(maxlen=HISTORY_POINTS)

    def base(self, now: float, window: float) -> Snapshot:
        """The newest snapshot at least ``window`` seconds before ``now``, else the oldest."""
        chosen = self.snapshots[0]
        for snap in self.snapshots:
            if now - snap.t < window:
                break
            chosen = snap
        return chosen

    def sample(self, now: float | None = None) -> None:
        """Snapshot the metrics and, from the second snapshot on, add the dashboard point it makes."""
        self.add(take_snapshot(self.metrics, now))

    def add(self, snap: Snapshot) -> None:
        """Keep a snapshot and the point it makes with the earlier ones (on the event loop, which reads them)."""
        if self.snapshots:
            self.points.append(make_point(snap, self.base(snap.t, RATE_WINDOW), self.base(snap.t, LATENCY_WINDOW)))
        self.snapshots.append(snap)

    def since(self, t: float, now: float | None = None) -> list[dict[str, Any]]:
        """Points newer than ``t``, sampling first when the sampler has fallen behind (e.g. no lifespan ran)."""
        now = time.time() if now is None else now
        if not self.snapshots or now - self.snapshots[-1].t > 2 * SAMPLE_INTERVAL:
            self.sample(now)
        return [p for p in self.points if p["t"] > t]


def dashboard_router(metrics: ServerMetrics) -> APIRouter:
    """``/dashboard``, its script and ``/dashboard/stats``; the sampler runs with the app's lifespan."""
    history = StatsHistory(metrics)
    page = (STATIC / "dashboard.html").read_bytes()
    script = (STATIC / "dashboard.js").read_bytes()

    async def sampler() -> None:
        while True:  # a collection reads /proc (and, with several API servers, their shared files): off the loop
            history.add(await asyncio.to_thread(take_snapshot, metrics))
            await asyncio.sleep(SAMPLE_INTERVAL)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        task = asyncio.create_task(sampler())
        try:
            yield
        finally:
            task.cancel()

    router = APIRouter(lifespan=lifespan)

    @router.get("/dashboard", include_in_schema=False)
    async def dashboard() -> Response:
        return Response(page, media_type="text/html; charset=utf-8")

    @router.get("/dashboard/dashboard.js", include_in_schema=False)
    async def dashboard_script() -> Response:
        return Response(script, media_type="text/javascript; charset=utf-8")

    @router.get("/dashboard/stats")
    async def stats(since: float = 0.0) -> JSONResponse:
        if not math.isfinite(since):
            raise APIError(400, f"since must be a finite number of seconds, got {since}", param="since")
        return JSONResponse(
            {
                "model": metrics.model_name,
                "interval_s": SAMPLE_INTERVAL,
                "rate_window_s": RATE_WINDOW,
                "latency_window_s": LATENCY_WINDOW,
                "points": history.since(since),
            }
        )

    return router
