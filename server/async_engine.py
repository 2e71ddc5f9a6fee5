"""Bridge between the asyncio server and the single-threaded engine.

The engine runs in its own thread: it executes queued commands (add, abort), steps while work is pending
and hands each step's outputs to the event loop with one ``call_soon_threadsafe``. The event loop never
waits on model compute. A request whose consumer goes away is aborted before the next step, which frees
its slots. If a step raises, every in-flight request is failed with the error and aborted, so no stream
hangs and the engine keeps serving.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from rnnserve.engine.llm_engine import LLMEngine
from rnnserve.engine.outputs import RequestOutput
from rnnserve.engine.sampling_params import InvalidParameterError, SamplingParams
from rnnserve.engine.sequence import SequenceGroup
from rnnserve.server.metrics import ServerMetrics

logger = logging.getLogger("rnnserve.engine")

Prompt = str | list[int]


class EngineDeadError(RuntimeError):
    """The engine thread is not running (shutting down or stopped)."""


@dataclass
class _Tracked:
    """Per-request bookkeeping kept by the engine thread (for metrics and delivery)."""

    sink: asyncio.Queue
    group: SequenceGroup
    arrival: float
    queue_time_seen: bool = False
    last_token_time: float | None = None


@dataclass
class Submission:
    """Requests added together (one HTTP call); their outputs arrive, interleaved, on one queue."""

    request_ids: list[str]
    queue: asyncio.Queue = field(repr=False)
    engine: AsyncEngine = field(repr=False)
    _open: set[str] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        self._open = set(self.request_ids)

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        """Yield outputs until every request finished; raises if the engine failed them."""
        while self._open:
            item = await self.queue.get()
            if isinstance(item, BaseException):
                self._open.clear()
                raise item
            if item.finished:
                self._open.discard(item.request_id)
            yield item

    def abort(self) -> None:
        """Abort whatever has not finished yet (idempotent)."""
        if self._open:
            self.engine.abort(list(self._open))
            self._open.clear()


class AsyncEngine:
    """Owns an :class:`LLMEngine` and the thread that drives it."""

    def __init__(self, engine: LLMEngine, metrics: ServerMetrics, idle_wait: float = 0.5) -> None:
        self.engine = engine
        self.metrics = metrics
        self.idle_wait = idle_wait
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._tracked: dict[str, _Tracked] = {}
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        metrics.set_pool(engine.pool.num_slots, engine.pool.bytes_per_slot)
        self._update_load()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="rnnserve-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Abort what is left, stop the thread and wait for it (bounded)."""
        self._stop.set()
        self._commands.put(lambda: None)
        if self._thread is not None:
            self._thread.join(timeout)
        self._thread = None

    async def submit(self, prompts: list[Prompt], params: SamplingParams) -> Submission:
        """Add one request per prompt (all or none); raises InvalidParameterError or QueueFullError."""
        if not self.running or self._loop is None:
            raise EngineDeadError("the engine is not running")
        sink: asyncio.Queue = asyncio.Queue()
        ids = [f"cmpl-{uuid.uuid4().hex}" for _ in prompts]
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        arrival = time.monotonic()

        def add() -> None:
            added: list[str] = []
            try:
                if params.n > self.engine.pool.num_slots:
                    raise InvalidParameterError(
                        "n", f"n={params.n} exceeds the server's {self.engine.pool.num_slots} state slots"
                    )
                for prompt, request_id in zip(prompts, ids, strict=True):
                    self.engine.add_request(prompt, params, request_id)
                    added.append(request_id)
                    group = self.engine.scheduler.waiting[-1]
                    assert group.request_id == request_id
                    self._tracked[request_id] = _Tracked(sink, group, arrival)
            except BaseException as err:  # roll back a partial batch, then report the first error
                for request_id in added:
                    self.engine.abort_request(request_id)
                    self._tracked.pop(request_id, None)
                done.set_exception(err)
            else:
                done.set_result(None)

        self._commands.put(add)
        waiter = asyncio.wrap_future(done)
        while not waiter.done():
            await asyncio.wait([waiter], timeout=self.idle_wait)
            if not waiter.done() and not self.running:
                waiter.cancel()
                raise EngineDeadError("the engine stopped before accepting the request")
        waiter.result()
        return Submission(ids, sink, self)

    def abort(self, request_ids: list[str]) -> None:
        """Ask the engine thread to abort requests; their slots are free before its next step."""

        def abort() -> None:
            now = time.monotonic()
            for request_id in request_ids:
                tracked = self._tracked.pop(request_id, None)
                if tracked is not None and self.engine.abort_request(request_id):
                    self.metrics.request_success.labels(finished_reason="abort").inc()
                    self.metrics.e2e_request_latency.observe(now - tracked.arrival)

        self._commands.put(abort)

    # --- engine thread -------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain_commands(block=not self.engine.has_unfinished_requests())
                if self._stop.is_set():
                    break
                if self.engine.has_unfinished_requests():
                    self._step()
        except BaseException as err:  # the loop itself failed: fail everything so nothing hangs
            logger.exception("engine thread crashed")
            self._fail_all(err)
            raise
        finally:
            self._drain_commands(block=False)
            self._fail_all(EngineDeadError("the server is shutting down"))

    def _drain_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=self.idle_wait) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            command()
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
        self._update_load()

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as err:
            logger.exception("engine step failed; failing the in-flight requests")
            self._fail_all(err)
            return
        now = time.monotonic()
        stats = self.engine.last_step
        m = self.metrics
        m.engine_step.observe(stats.seconds)
        if stats.decode_batch_size:
            m.decode_batch_size.observe(stats.decode_batch_size)
        m.prompt_tokens.inc(stats.prefill_tokens)
        m.generation_tokens.inc(stats.generated_tokens)
        deliveries: list[tuple[asyncio.Queue, RequestOutput | BaseException]] = []
        for tracked in self._tracked.values():
            if not tracked.queue_time_seen and tracked.group.first_scheduled_time is not None:
                tracked.queue_time_seen = True
                m.request_queue_time.observe(tracked.group.first_scheduled_time - tracked.arrival)
        for out in outputs:
            tracked = self._tracked.get(out.request_id)
            if tracked is None:
                continue
            if any(o.new_token_ids for o in out.outputs):
                if tracked.last_token_time is None:
                    m.time_to_first_token.observe(now - tracked.arrival)
                else:
                    m.inter_token_latency.observe(now - tracked.last_token_time)
                tracked.last_token_time = now
            if out.finished:
                del self._tracked[out.request_id]
                m.e2e_request_latency.observe(now - tracked.arrival)
                m.request_success.labels(finished_reason=out.outputs[0].finish_reason or "stop").inc()
            deliveries.append((tracked.sink, out))
        self._update_load()
        self._deliver(deliveries)

    def _fail_all(self, err: BaseException) -> None:
        deliveries: list[tuple[asyncio.Queue, RequestOutput | BaseException]] = []
        now = time.monotonic()
        for request_id, tracked in list(self._tracked.items()):
            self.engine.abort_request(request_id)
            self.metrics.request_success.labels(finished_reason="abort").inc()
            self.metrics.e2e_request_latency.observe(now - tracked.arrival)
            deliveries.append((tracked.sink, err))
        self._tracked.clear()
        self._update_load()
        self._deliver(deliveries)

    def _deliver(self, deliveries: list[tuple[asyncio.Queue, RequestOutput | BaseException]]) -> None:
        if not deliveries or self._loop is None:
            return

        def put_all() -> None:
            for sink, item in deliveries:
                sink.put_nowait(item)

        try:
            self._loop.call_soon_threadsafe(put_all)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    def _update_load(self) -> None:
        e = self.engine
        self.metrics.set_load(
            e.scheduler.num_running, e.scheduler.num_waiting, e.pool.num_used, e.pool.bytes_per_slot
        )
