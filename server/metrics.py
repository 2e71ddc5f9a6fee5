"""Prometheus metrics of one server (names are a stable contract: dashboards depend on them), and the periodic
throughput log line.

Each server owns its own ``CollectorRegistry`` so several apps can live in one process (tests). Every rnnserve
series carries a ``model_name`` label (the first served name), as vLLM's do; the registry also holds the
standard ``process_*`` series (CPU seconds, resident memory, open files). See ``docs/metrics.md`` for meanings
and units.

Several API server processes in front of one engine (``--api-servers``) share their counters and histograms
through prometheus-client's multiprocess mode (``$PROMETHEUS_MULTIPROC_DIR``, set before they start): whichever
process answers a scrape reports the sums over all of them. The engine's step series come from one of them
only, its load gauges from the scraped one (every process gets every load), ``process_*`` from the scraped one.
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
import threading
import time
from bisect import bisect_left
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from rnnserve.engine.llm_engine import EngineLoad, StepStats
from rnnserve.engine.outputs import RequestOutput
from rnnserve.engine.sampling_params import SamplingParams
from rnnserve.server.config import MULTIPROCESS_DIR_ENV

logger = logging.getLogger("rnnserve.metrics")

LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
    80.0, 160.0, 320.0,
)  # fmt: skip
TOKEN_LATENCY_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
    0.5, 0.75, 1.0, 2.5,
)  # fmt: skip
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 1024)
N_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
FINISH_REASONS = ("stop", "length", "abort", "error")
STATS_LOG_INTERVAL = 10.0


class ServerProcesses:
    """The CPU time and memory of all of a server's processes (Linux): the ``rnnserve serve`` process and what it
    started, the engine process (``--engine-process``) and the API servers (``--api-servers``), which the
    ``process_*`` series, of the scraped process alone, leave out.

    CPU counts each live process's own time and that of the children it reaped (a kernel build's compilers), so
    the sum does not fall when such a child ends. ``root`` is the serve process: this one, or its parent for an
    API server of several."""

    def __init__(self, model_name: str, root: int) -> None:
        self.model_name = model_name
        self.root = root
        self.ticks = os.sysconf("SC_CLK_TCK")
        self.page_bytes = os.sysconf("SC_PAGE_SIZE")

    def collect(self) -> Iterator[Metric]:
        processes = self.tree()
        if not processes:  # no /proc
            return
        cpu = CounterMetricFamily("rnnserve_server_processes_cpu_seconds",
                                  "CPU time of all the server's processes, user + system, reaped children included.",
                                  labels=["model_name"])  # fmt: skip
        cpu.add_metric([self.model_name], sum(ticks for ticks, _ in processes.values()) / self.ticks)
        rss = GaugeMetricFamily("rnnserve_server_processes_resident_memory_bytes",
                                "Resident memory of all the server's processes (pages they share counted in each).",
                                labels=["model_name"])  # fmt: skip
        rss.add_metric([self.model_name], sum(pages for _, pages in processes.values()) * self.page_bytes)
        count = GaugeMetricFamily("rnnserve_server_processes", "Processes of the server.", labels=["model_name"])
        count.add_metric([self.model_name], len(processes))
        yield from (cpu, rss, count)

    def tree(self) -> dict[int, tuple[int, int]]:
        """``{pid: (CPU ticks, resident pages)}`` of the root and its descendants (empty without /proc)."""
        stats: dict[int, tuple[int, int, int]] = {}  # pid -> parent, ticks, pages
        try:
            names = os.listdir("/proc")
        except OSError:
            return {}
        for name in names:
            if not name.isdigit():
                continue
            try:
                with open(f"/proc/{name}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()  # after the command, which may hold spaces
            except (OSError, IndexError):
                continue  # ended meanwhile, or not ours to read
            # fields[0] is the state (stat's 3rd field): parent 4th, utime..cstime 14th-17th, rss 24th
            stats[int(name)] = (int(fields[1]), sum(map(int, fields[11:15])), int(fields[21]))
        children: dict[int, list[int]] = collections.defaultdict(list)
        for pid, (parent, _, _) in stats.items():
            children[parent].append(pid)
        found, todo = {}, [self.root] if self.root in stats else []
        while todo:
            pid = todo.pop()
            found[pid] = stats[pid][1:]
            todo += children[pid]
        return found


def token_buckets(max_len: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_len`` (the bucket scale vLLM uses for token counts)."""
    buckets: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * scale
            if value > max_len:
                return (*buckets, max_len) if not buckets or buckets[-1] < max_len else tuple(buckets)
            buckets.append(value)
        scale *= 10


class StepHistogram:
    """A Prometheus histogram with one ``model_name`` label that takes a step's observations at once (a step at
    batch 256 has 256 inter-token latencies): one lock per call, where ``prometheus_client.Histogram`` takes
    two per observation on the engine thread. Exposed exactly as that histogram (``_bucket``, ``_count``,
    ``_sum``, ``_created``)."""

    def __init__(
        self, name: str, documentation: str, buckets: Sequence[float], model_name: str, registry: CollectorRegistry
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.model_name = model_name
        self._bounds = (*buckets, float("inf"))
        self._counts = [0] * len(self._bounds)
        self._sum = 0.0
        self._created = time.time()
        self._lock = threading.Lock()
        registry.register(self)

    def observe_many(self, values: Sequence[float]) -> None:
        """Count each value in the first bucket whose upper bound is at least the value."""
        slots = [bisect_left(self._bounds, value) for value in values]
        total = sum(values)
        with self._lock:
            for slot in slots:
                self._counts[slot] += 1
            self._sum += total

    def observe(self, value: float) -> None:
        self.observe_many((value,))

    def observe_repeated(self, value: float, count: int) -> None:
        """``observe_many`` of ``count`` times ``value``, without a list of them (the sum added up the same way)."""
        if count <= 0:
            return
        slot = bisect_left(self._bounds, value)
        total = sum(itertools.repeat(value, count))
        with self._lock:
            self._counts[slot] += count
            self._sum += total

    def describe(self) -> list[Metric]:
        return [HistogramMetricFamily(self.name, self.documentation, labels=["model_name"])]

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            counts, total = list(self._counts), self._sum
        family = HistogramMetricFamily(self.name, self.documentation, labels=["model_name"])
        buckets = zip(map(floatToGoString, self._bounds), itertools.accumulate(counts), strict=True)
        family.add_metric([self.model_name], list(buckets), total)
        family.samples.append(Sample(f"{self.name}_created", {"model_name": self.model_name}, self._created))
        yield family


class SharedStepHistogram:
    """:class:`StepHistogram`'s interface over a prometheus-client histogram, whose values the API server processes
    share in multiprocess mode (a custom collector's would stay in the process that observed them)."""

    def __init__(self, histogram: Histogram) -> None:
        self.histogram = histogram

    def observe_many(self, values: Sequence[float]) -> None:
        """``observe`` of each value, with one shared-memory write per bucket hit and one for the sum: each
        write takes ~2 us in multiprocess mode, and a step brings one inter-token latency per stream (256
        values cost ~1.1 ms one by one). Written against prometheus-client's ``Histogram`` internals as its
        ``observe`` uses them (``_upper_bounds``, the per-bucket ``_buckets``, ``_sum``; a test compares the
        two ways' exposition)."""
        if not values:
            return
        histogram = self.histogram
        bounds, buckets = histogram._upper_bounds, histogram._buckets
        for bucket, count in collections.Counter(bisect_left(bounds, value) for value in values).items():
            buckets[bucket].inc(count)
        histogram._sum.inc(sum(values))

    def observe(self, value: float) -> None:
        self.histogram.observe(value)

    def observe_repeated(self, value: float, count: int) -> None:
        """``observe_many`` of ``count`` times ``value``: one write to its bucket, one to the sum."""
        if count <= 0:
            return
        histogram = self.histogram
        histogram._buckets[bisect_left(histogram._upper_bounds, value)].inc(count)
        histogram._sum.inc(sum(itertools.repeat(value, count)))


# The pool's slot gauge under its first name, whose counter's suffix breaks Prometheus' naming rules (promtool
# check metrics flags it): exported beside rnnserve_state_slots for one release, then removed (docs/metrics.md).
DEPRECATED_STATE_SLOTS = "rnnserve_state_slots_total"

LOAD_GAUGES = (
    ("rnnserve_num_requests_running", "Sequences holding a state slot (prefilling or decoding)."),
    ("rnnserve_num_requests_waiting", "Requests queued for a free slot, or for their structured output to compile."),
    ("rnnserve_num_requests_compiling", "Waiting requests whose structured output compiles first."),
    ("rnnserve_state_slots_used", "State slots in use."),
    ("rnnserve_state_usage_perc", "Fraction of the state pool in use, 0 to 1 (vLLM's kv_cache_usage_perc)."),
    ("rnnserve_state_memory_used_bytes", "Bytes of state held by running sequences."),
)
TIER_GAUGES = (
    (
        "rnnserve_prefix_cache_memory_used_bytes",
        "Bytes of prefix-cache snapshots held, per tier (the last tier counts the cache's token keys too).",
    ),
    ("rnnserve_prefix_cache_memory_total_bytes", "Bytes of prefix-cache snapshot memory, per tier."),
    ("rnnserve_prefix_cache_snapshots", "Prefix-cache snapshots held, per tier."),
)


class LoadGauges:
    """The gauges of the engine's load (requests, slots, state memory, prefix-cache tiers), computed from the
    latest :class:`EngineLoad` when the registry is collected. Every engine event carries a load, hundreds a
    second under load; setting eight labelled gauges on each cost the event loop 5-20 us an event."""

    def __init__(self, model_name: str, registry: CollectorRegistry) -> None:
        self.model_name = model_name
        self.load = EngineLoad(num_running=0, num_waiting=0, num_slots=0, slots_used=0, bytes_per_slot=0)
        registry.register(self)

    def describe(self) -> list[Metric]:
        return [GaugeMetricFamily(name, doc, labels=["model_name"]) for name, doc in LOAD_GAUGES] + [
            GaugeMetricFamily(name, doc, labels=["model_name", "tier"]) for name, doc in TIER_GAUGES
        ]

    def collect(self) -> Iterator[Metric]:
        load = self.load
        usage = load.slots_used / load.num_slots if load.num_slots else 0.0
        values = (load.num_running, load.num_waiting, load.num_compiling, load.slots_used, usage,
                  load.slots_used * load.bytes_per_slot)  # fmt: skip
        for (name, doc), value in zip(LOAD_GAUGES, values, strict=True):
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family
        for index, (name, doc) in enumerate(TIER_GAUGES if load.prefix_cache else ()):  # absent with the cache off
            family = GaugeMetricFamily(name, doc, labels=["model_name", "tier"])
            for tier in load.prefix_cache:
                value = (tier.used_bytes, tier.capacity_bytes, tier.num_snapshots)[index]
                family.add_metric([self.model_name, tier.name], value)
            yield family


SESSION_OPERATIONS = ("create", "fork", "import", "export", "delete")
STORED_SESSION_GAUGES = (
    ("rnnserve_sessions", "Sessions stored."),
    ("rnnserve_session_bytes", "Bytes of the stored session files."),
    ("rnnserve_sessions_limit", "Sessions stored at most (--max-sessions)."),
    ("rnnserve_session_bytes_limit", "Bytes of session files stored at most (--max-session-bytes)."),
)


class SessionMetrics:
    """What the session store does (counters), its host-memory LRU (gauges) and, once a store watches them
    (:meth:`watch_store`), what it stores. With several API servers the counters are summed over them, and so are
    the LRU's gauges (each server has an LRU of its own: ``livesum``); the stored-session gauges are the value the
    last server to change the shared folder set (``mostrecent``), so a scrape reads no folder."""

    def __init__(self, model_name: str, registry: CollectorRegistry) -> None:
        self.model_name = model_name
        self._registry = registry
        self._stored: tuple[Gauge, Gauge] | None = None

        def counter(name: str, documentation: str) -> Counter:
            return Counter(name, documentation, ["model_name"], registry=registry).labels(model_name=model_name)

        def gauge(name: str, documentation: str) -> Gauge:
            metric = Gauge(name, documentation, ["model_name"], registry=registry, multiprocess_mode="livesum")
            return metric.labels(model_name=model_name)

        self.turns = counter("rnnserve_session_turns", "Session requests whose state was stored.")
        self._operations = Counter(
            "rnnserve_session_operations",
            "Session operations done, by operation (create, fork, import, export, delete).",
            ["model_name", "operation"],
            registry=registry,
        )
        self.rejected = counter(
            "rnnserve_session_rejected", "Session writes answered 429 (--max-sessions or --max-session-bytes)."
        )
        self.expired = counter("rnnserve_session_expired", "Sessions deleted after going unused for --session-ttl.")
        self.cache_queries = counter("rnnserve_session_cache_queries", "Session loads that looked up the LRU.")
        self.cache_hits = counter("rnnserve_session_cache_hits", "Session loads the LRU answered without the disk.")
        self.cache_memory_used_bytes = gauge(
            "rnnserve_session_cache_memory_used_bytes", "Host memory of the sessions the LRU holds decoded."
        )
        self.cache_memory_total_bytes = gauge(
            "rnnserve_session_cache_memory_total_bytes", "Host memory for the LRU (--session-cache-bytes)."
        )
        for operation in SESSION_OPERATIONS:
            self.operation(operation)

    @classmethod
    def unregistered(cls) -> SessionMetrics:
        """Metrics that no registry exports (a store built without a server)."""
        return cls("", CollectorRegistry())

    def operation(self, operation: str) -> Counter:
        """The counter of one session operation."""
        return self._operations.labels(model_name=self.model_name, operation=operation)

    def watch_store(self, max_sessions: int, max_bytes: int) -> None:
        """Export the stored-session gauges and their limits (a server with ``--no-sessions`` has none); a store
        then keeps them up to date with :meth:`set_stored`. Idempotent."""
        if self._stored is not None:
            return
        gauges = [Gauge(name, documentation, ["model_name"], registry=self._registry, multiprocess_mode="mostrecent")
                  .labels(model_name=self.model_name) for name, documentation in STORED_SESSION_GAUGES]  # fmt: skip
        gauges[2].set(max_sessions)
        gauges[3].set(max_bytes)
        self._stored = (gauges[0], gauges[1])

    def set_stored(self, sessions: int, nbytes: int) -> None:
        """The sessions stored now and their files' bytes (no-op until :meth:`watch_store`)."""
        if self._stored is not None:
            self._stored[0].set(sessions)
            self._stored[1].set(nbytes)


class ServerMetrics:
    """All metrics the server exports; updated from the engine thread (prometheus-client is thread-safe)."""

    def __init__(self, model_name: str, max_model_len: int, registry: CollectorRegistry | None = None) -> None:
        self.model_name = model_name
        self.registry = registry or CollectorRegistry()  # what /metrics and the dashboard collect
        self.multiprocess = MULTIPROCESS_DIR_ENV in os.environ
        self._own = self.registry  # where the metrics register (their values are in files when shared)
        if self.multiprocess:
            self._own = CollectorRegistry()
            MultiProcessCollector(self.registry)
        ProcessCollector(registry=self.registry)
        self.registry.register(ServerProcesses(model_name, os.getppid() if self.multiprocess else os.getpid()))
        tokens = token_buckets(max_model_len)
        self._load = LoadGauges(model_name, self.registry)
        self.state_slots = self._gauge("rnnserve_state_slots", "State slots in the pool.")
        self.state_slots_deprecated = self._gauge(
            DEPRECATED_STATE_SLOTS, "Deprecated alias of rnnserve_state_slots (a gauge's name must not end in _total)."
        )
        self.state_bytes_per_slot = self._gauge("rnnserve_state_bytes_per_slot", "Bytes of recurrent state per slot.")
        self.state_memory_total_bytes = self._gauge(
            "rnnserve_state_memory_total_bytes", "Bytes of the preallocated state pool."
        )
        self.prompt_tokens = self._counter("rnnserve_prompt_tokens", "Prompt tokens prefilled.")
        self.prefix_cache_queries = self._counter(
            "rnnserve_prefix_cache_queries", "Requests admitted that looked up the prefix cache."
        )
        self.prefix_cache_hits = self._counter(
            "rnnserve_prefix_cache_hits", "Requests that resumed from a prefix-cache snapshot."
        )
        self.prefix_cache_hit_tokens = self._counter(
            "rnnserve_prefix_cache_hit_tokens", "Prompt tokens not prefilled thanks to a prefix-cache snapshot."
        )
        self.generation_tokens = self._counter("rnnserve_generation_tokens", "Tokens generated.")
        self._request_success = Counter(
            "rnnserve_request_success",
            "Finished requests by finish reason (stop, length, abort, error).",
            ["model_name", "finished_reason"],
            registry=self._own,
        )
        self.request_rejected = self._counter(
            "rnnserve_request_rejected", "Requests answered 429 because the waiting queue was full."
        )
        self.time_to_first_token = self._step_histogram(
            "rnnserve_time_to_first_token_seconds", "Arrival to first generated token.", LATENCY_BUCKETS
        )
        self.inter_token_latency = self._step_histogram(
            "rnnserve_inter_token_latency_seconds", "Time between successive tokens of a request.",
            TOKEN_LATENCY_BUCKETS,
        )
        self.e2e_request_latency = self._histogram(
            "rnnserve_e2e_request_latency_seconds", "Arrival to finish of a request.", LATENCY_BUCKETS
        )
        self.request_queue_time = self._step_histogram(
            "rnnserve_request_queue_time_seconds", "Arrival to admission into a state slot.", LATENCY_BUCKETS
        )
        self.request_prefill_time = self._histogram(
            "rnnserve_request_prefill_time_seconds", "Admission to first token (the prompt's prefill).",
            LATENCY_BUCKETS,
        )
        self.request_decode_time = self._histogram(
            "rnnserve_request_decode_time_seconds", "First token to last token of a finished request.",
            LATENCY_BUCKETS,
        )
        self.request_inference_time = self._histogram(
            "rnnserve_request_inference_time_seconds", "Admission to finish (prefill + decode).", LATENCY_BUCKETS
        )
        self.request_prompt_tokens = self._histogram(
            "rnnserve_request_prompt_tokens", "Prompt tokens of a finished request.", tokens
        )
        self.request_generation_tokens = self._histogram(
            "rnnserve_request_generation_tokens", "Generated tokens of a finished request (all samples).", tokens
        )
        self.request_params_n = self._histogram("rnnserve_request_params_n", "The n of admitted requests.", N_BUCKETS)
        self.request_params_max_tokens = self._histogram(
            "rnnserve_request_params_max_tokens", "The max_tokens of admitted requests.", tokens
        )
        self.engine_step = self._histogram(
            "rnnserve_engine_step_seconds", "Duration of one engine step (prefill + decode + sampling).",
            TOKEN_LATENCY_BUCKETS,
        )
        self.engine_device_wait = self._counter(
            "rnnserve_engine_device_wait_seconds",
            "Of the engine steps' time, the host's wait for the device's sampled tokens (0 on a CPU).",
        )
        self.decode_batch_size = self._histogram(
            "rnnserve_decode_batch_size", "Sequences decoded together in one engine step.", BATCH_SIZE_BUCKETS
        )
        self.sessions = SessionMetrics(model_name, self._own)
        for reason in FINISH_REASONS:
            self.request_success(reason)

    def _gauge(self, name: str, documentation: str) -> Gauge:
        gauge = Gauge(name, documentation, ["model_name"], registry=self._own, multiprocess_mode="mostrecent")
        return gauge.labels(model_name=self.model_name)

    def _counter(self, name: str, documentation: str) -> Counter:
        return Counter(name, documentation, ["model_name"], registry=self._own).labels(model_name=self.model_name)

    def _histogram(self, name: str, documentation: str, buckets: tuple[float, ...]) -> Histogram:
        metric = Histogram(name, documentation, ["model_name"], buckets=buckets, registry=self._own)
        return metric.labels(model_name=self.model_name)

    def _step_histogram(
        self, name: str, documentation: str, buckets: tuple[float, ...]
    ) -> StepHistogram | SharedStepHistogram:
        if self.multiprocess:
            return SharedStepHistogram(self._histogram(name, documentation, buckets))
        return StepHistogram(name, documentation, buckets, self.model_name, self.registry)

    def request_success(self, finished_reason: str) -> Counter:
        """The finished-requests counter of one finish reason."""
        return self._request_success.labels(model_name=self.model_name, finished_reason=finished_reason)

    def set_pool(self, num_slots: int, bytes_per_slot: int) -> None:
        self.state_slots.set(num_slots)
        self.state_slots_deprecated.set(num_slots)
        self.state_bytes_per_slot.set(bytes_per_slot)
        self.state_memory_total_bytes.set(num_slots * bytes_per_slot)

    def set_load(self, load: EngineLoad) -> None:
        """The engine's load now (exported when the registry is collected, see :class:`LoadGauges`)."""
        self._load.load = load

    def observe_engine_died(self, num_failed: int) -> None:
        """The engine died: the ``num_failed`` requests in flight failed with it (their clients got an error), and
        nothing runs, waits or holds a slot any more (the gauges kept the load before the death)."""
        self.request_success("error").inc(num_failed)
        self._load.load = replace(
            self._load.load, num_running=0, num_waiting=0, num_compiling=0, slots_used=0, prefix_cache=[]
        )

    def observe_admitted(self, params: SamplingParams) -> None:
        """One engine request was queued with ``params``."""
        self.request_params_n.observe(params.n)
        self.request_params_max_tokens.observe(params.max_tokens)

    def observe_step(self, stats: StepStats) -> None:
        """One engine step: its duration, batch and token counts and its token latencies (queue time and TTFT
        at a request's first token, the inter-token latency at each later one); its finished requests go to
        :meth:`observe_outputs`."""
        self.engine_step.observe(stats.seconds)
        if stats.device_wait_seconds:
            self.engine_device_wait.inc(stats.device_wait_seconds)
        if stats.decode_batch_size:
            self.decode_batch_size.observe(stats.decode_batch_size)
        self.prompt_tokens.inc(stats.prefill_tokens)
        self.generation_tokens.inc(stats.generated_tokens)
        self.prefix_cache_queries.inc(stats.prefix_cache_queries)
        self.prefix_cache_hits.inc(stats.prefix_cache_hits)
        self.prefix_cache_hit_tokens.inc(stats.prefix_cache_hit_tokens)
        self.request_queue_time.observe_many(stats.latencies.queue)
        self.time_to_first_token.observe_many(stats.latencies.first_token)
        self.inter_token_latency.observe_many(stats.latencies.inter_token)
        self.inter_token_latency.observe_repeated(stats.latencies.same_inter_token,
                                                  stats.latencies.same_inter_token_count)  # fmt: skip

    def observe_outputs(self, outputs: list[RequestOutput]) -> None:
        """The finished requests among ``outputs``: their end-to-end, prefill, decode and inference times, token
        counts and finish reason."""
        for out in outputs:
            if out.finished:
                self.observe_finished(out)

    def observe_finished(self, out: RequestOutput) -> None:
        times = out.metrics
        if times.finished_time is not None:
            self.e2e_request_latency.observe(times.finished_time - times.arrival_time)
            if times.first_scheduled_time is not None:
                self.request_inference_time.observe(times.finished_time - times.first_scheduled_time)
        if times.first_token_time is not None:
            if times.first_scheduled_time is not None:
                self.request_prefill_time.observe(times.first_token_time - times.first_scheduled_time)
            if times.last_token_time is not None:
                self.request_decode_time.observe(times.last_token_time - times.first_token_time)
        self.request_prompt_tokens.observe(len(out.prompt_token_ids))
        self.request_generation_tokens.observe(sum(s.num_tokens for s in out.outputs))
        reason = "error" if out.error is not None else out.outputs[0].finish_reason or "abort"
        self.request_success(reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


@dataclass
class StatLogger:
    """Logs one line every ``interval`` seconds while the engine works, as vLLM does: prompt and generation
    throughput over the interval, running and waiting requests, and the state pool's usage. Called from the
    engine thread after each step. An idle engine blocks on its queue and logs nothing; the first step after
    an idle spell starts a new interval, so idle time never dilutes the throughput."""

    interval: float = STATS_LOG_INTERVAL
    prompt_tokens: int = 0
    generation_tokens: int = 0
    window_start: float = float("-inf")
    last_step: float = float("-inf")

    def record(self, stats: StepStats, load: EngineLoad, now: float | None = None) -> str | None:
        """Count one step's tokens; at the end of an interval, log (and return) the line."""
        now = time.monotonic() if now is None else now
        if now - self.last_step > self.interval:
            self.prompt_tokens = self.generation_tokens = 0
            self.window_start = now - stats.seconds
        self.last_step = now
        self.prompt_tokens += stats.prefill_tokens
        self.generation_tokens += stats.generated_tokens
        elapsed = now - self.window_start
        if elapsed < self.interval:
            return None
        usage = 100.0 * load.slots_used / load.num_slots if load.num_slots else 0.0
        line = (
            f"Avg prompt throughput: {self.prompt_tokens / elapsed:.1f} tokens/s, "
            f"Avg generation throughput: {self.generation_tokens / elapsed:.1f} tokens/s, "
            f"Running: {load.num_running} reqs, Waiting: {load.num_waiting} reqs, State usage: {usage:.1f}%"
        )
        logger.info("%s", line)
        self.prompt_tokens = self.generation_tokens = 0
        self.window_start = now
        return line
