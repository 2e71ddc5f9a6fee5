"""Bridge between the asyncio server and the engine loop.

The engine loop (:class:`~rnnserve.server.engine_core.EngineCore`) runs in a thread of this process or in a
process of its own; either way it takes commands (add, abort, stop) and reports events (an add's outcome, a
step's outputs, aborts, failures), which are handled here on the event loop: outputs are routed to the
:class:`Submission` that consumes each request, metrics are kept up to date. What the bridge knows about a
request is only which submission consumes it. A request the engine fails (``RequestOutput.error``) fails its
submission alone; if ``engine.step()`` itself raises, every in-flight request fails and is aborted; if the loop
ends (or its process dies), every in-flight request fails and no more are taken.

The bridge also bounds the memory that queued requests hold: the prompts of submissions that have not yet
had a first token count against ``max_queued_bytes``. It logs a throughput line every 10 s while busy, and
says whether the server is ready for requests (``/ready``).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable

from rnnserve.engine.llm_engine import LLMEngine
from rnnserve.engine.outputs import RequestOutput, merge_deltas
from rnnserve.engine.sampling_params import InvalidParameterError, OutputKind, SamplingParams
from rnnserve.engine.scheduler import QueueFullError
from rnnserve.engine.state_snapshot import StateSnapshot
from rnnserve.server.engine_core import (
    SHUTDOWN_MESSAGE,
    AbortCommand,
    Aborted,
    AddCommand,
    Added,
    EngineDriver,
    Event,
    LoadChanged,
    Prompt,
    StepFailed,
    Stepped,
)
from rnnserve.server.metrics import ServerMetrics, StatLogger

TOKEN_ID_BYTES = 8  # what the engine holds per prompt token id, roughly


def prompt_bytes(prompts: list[Prompt]) -> int:
    """The size of prompts as they wait in the queue: UTF-8 bytes of text, 8 bytes per token id."""
    return sum(len(p.encode()) if isinstance(p, str) else TOKEN_ID_BYTES * len(p) for p in prompts)


class EngineDeadError(RuntimeError):
    """The engine loop is not running (shutting down, stopped, or its process died)."""


class RequestFailedError(RuntimeError):
    """The engine failed this request alone while processing it."""


logger = logging.getLogger("rnnserve.server")

COALESCE_BACKLOG = 16  # queued outputs of a stream beyond which new ones are merged into the last


class Submission:
    """The engine requests of one HTTP call: ``request_id`` is the call's (the response's ``id``),
    ``request_ids`` the engine's, one per prompt. Their outputs arrive, interleaved, on one queue (:meth:`put`).

    ``on_finished`` (optional) runs on each request's final output before :meth:`outputs` yields it (a session
    stores its state there, before the client sees the end of the answer); ``on_close`` callbacks run once,
    at the first :meth:`abort`, which every response calls when it ends.

    With ``coalesce`` (``DELTA`` outputs, i.e. streams), outputs of one request that queued up while the
    consumer was busy are merged into one: a stream that falls behind the engine sends one chunk with several
    tokens, so the cost per token of the event loop and of the client falls as the load rises."""

    def __init__(
        self, bridge: AsyncEngine, request_id: str, request_ids: list[str], queued_bytes: int, coalesce: bool = False
    ) -> None:
        self.bridge = bridge
        self.request_id = request_id
        self.request_ids = request_ids
        self.queued_bytes = queued_bytes
        self.coalesce = coalesce
        self._loop = asyncio.get_running_loop()
        self.accepted: asyncio.Future[None] = self._loop.create_future()
        self.on_finished: Callable[[RequestOutput], Awaitable[None]] | None = None
        self.on_close: list[Callable[[], None]] = []
        self._items: deque[RequestOutput | BaseException] = deque()  # what outputs() has not read yet
        self._waiter: asyncio.Future[None] | None = None  # outputs() waits on it while _items is empty
        self._remaining = len(request_ids)  # requests whose final output has not been read

    def put(self, item: RequestOutput | BaseException) -> None:
        """Queue an output, or the error that ends the submission, for :meth:`outputs` (on the event loop). With
        ``coalesce``, a backlog (a client that does not read) keeps its outputs merged as they come: one step's
        output object each held a stream's tokens 6x over (38 MB for an unread 30,000-token stream)."""
        if self.coalesce and len(self._items) >= COALESCE_BACKLOG and isinstance(item, RequestOutput):
            last = self._items[-1]
            if (isinstance(last, RequestOutput) and last.request_id == item.request_id and not last.finished
                    and last.error is None and item.error is None):  # fmt: skip
                self._items[-1] = merge_deltas(last, item)
                return
        self._items.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def has_queued(self) -> bool:
        """Whether an output (or error) is waiting to be read."""
        return bool(self._items)

    async def next_output(self) -> RequestOutput | None:
        """The next output, or ``None`` once every request's final output was read. Raises
        :class:`RequestFailedError` when the engine failed one of the requests (:class:`InvalidParameterError`
        when the request's own parameter did, e.g. a grammar that met llguidance's limits), or the error that
        failed the whole engine (or what ``on_finished`` raised). A coroutine, not an async generator: a stream
        reads one per token, and each ``anext`` of a generator costs an object and a frame more."""
        if not self._remaining:
            return None
        items = self._items
        while not items:
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        item = items.popleft()
        if self.coalesce and items:
            item = self._merge_queued(item)
        if isinstance(item, BaseException):
            raise item
        if item.error_param is not None:
            raise InvalidParameterError(item.error_param, item.error or "")
        if item.error is not None:
            raise RequestFailedError(item.error)
        if item.finished:
            self._remaining -= 1
            if self.on_finished is not None:
                await self.on_finished(item)
        return item

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        """Yield outputs until every request finished (:meth:`next_output`, which says what it raises)."""
        while (item := await self.next_output()) is not None:
            yield item

    def _merge_queued(self, item: RequestOutput | BaseException) -> RequestOutput | BaseException:
        """``item`` with the outputs queued right behind it for the same request merged in, up to the first
        that cannot be (another request's, an error), which stays queued."""
        items = self._items
        while isinstance(item, RequestOutput) and not item.finished and items:
            following = items[0]
            if (
                not isinstance(following, RequestOutput)
                or following.request_id != item.request_id
                or following.error is not None
            ):
                break
            item = merge_deltas(item, items.popleft())
        return item

    def fail(self, error: BaseException) -> None:
        """End the submission with ``error``: before it was accepted, or mid-generation."""
        if self.accepted.done():
            self.put(error)
        else:
            self.accepted.set_exception(error)

    def abort(self) -> None:
        """Abort whatever has not finished yet and run the ``on_close`` callbacks (idempotent)."""
        self.bridge.abort(self)
        callbacks, self.on_close = self.on_close, []
        for callback in callbacks:
            callback()


class AsyncEngine:
    """The server's handle on its engine, which runs where ``driver`` runs it (a thread of this process or a
    process of its own, see :mod:`rnnserve.server.engine_core`). ``info`` describes the engine; ``engine`` is
    the live :class:`LLMEngine` when it is in this process (until :meth:`stop`), else ``None``. Public methods
    run on the event loop."""

    def __init__(self, driver: EngineDriver, metrics: ServerMetrics, max_queued_bytes: int | None = None) -> None:
        self.driver = driver
        self.info = driver.info
        self.engine: LLMEngine | None = driver.engine
        self.metrics = metrics
        self.max_queued_bytes = max_queued_bytes
        self.queued_bytes = 0
        self.draining = False
        self.stat_logger = StatLogger()
        self._consumers: dict[str, Submission] = {}
        self._adds: dict[int, tuple[asyncio.Future[None], SamplingParams, int]] = {}
        self._add_ids = itertools.count()
        self._stopping = False
        self._accepting = False
        metrics.set_pool(self.info.num_slots, self.info.bytes_per_slot)
        metrics.set_load(self.info.load)

    @property
    def running(self) -> bool:
        return self.driver.running

    def not_ready_reason(self) -> str | None:
        """Why the server cannot take requests now, or ``None`` when it can. An AsyncEngine exists only once
        the model is loaded and, on CPU, the fused kernels are built (``LLMEngine`` does both before it returns),
        so what remains is the engine loop running and the server not shutting down."""
        if self.draining:
            return SHUTDOWN_MESSAGE
        if not self.running or not self._accepting:
            return "the engine is not running"
        return None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._accepting = True
        self.driver.start(loop, self._handle)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the engine loop and wait for it (bounded); pending requests fail with EngineDeadError. Blocks:
        call it off the event loop."""
        self._stopping = True
        self.driver.stop(timeout)
        self.engine = None  # as the driver lets go of it (see ThreadDriver.stop)

    async def submit(
        self,
        request_id: str,
        prompts: list[Prompt],
        params: SamplingParams,
        context: StateSnapshot | None = None,
        return_state: bool = False,
    ) -> Submission:
        """Add one engine request per prompt, all or none, with ids ``request_id`` (one prompt) or
        ``request_id-<prompt index>``; ``context`` and ``return_state`` as in ``LLMEngine.add_request``. Raises
        what the engine's ``add_request`` raises (InvalidParameterError, QueueFullError, ValueError),
        QueueFullError when the queued prompts would pass ``max_queued_bytes`` (unless nothing is queued), or
        EngineDeadError."""
        if not self._accepting:
            raise EngineDeadError("the engine is not running")
        size = prompt_bytes(prompts)
        if context is not None:
            size += TOKEN_ID_BYTES * len(context.history_token_ids)
        if self.max_queued_bytes is not None and self.queued_bytes and self.queued_bytes + size > self.max_queued_bytes:
            self.metrics.request_rejected.inc()
            raise QueueFullError(
                f"queued prompts hold {self.queued_bytes} bytes, this one {size} (limit {self.max_queued_bytes})"
            )
        ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]
        submission = Submission(self, request_id, ids, size, params.output_kind is OutputKind.DELTA)
        self.queued_bytes += size
        self._consumers.update(dict.fromkeys(ids, submission))
        add_id = next(self._add_ids)
        self._adds[add_id] = (submission.accepted, params, len(ids))
        self.driver.send(AddCommand(add_id, ids, prompts, params, time.monotonic(), context, return_state))
        try:
            await submission.accepted
        except BaseException as err:  # rejected (nothing was added) or cancelled (abort what may have been)
            self.abort(submission)
            if isinstance(err, QueueFullError):
                self.metrics.request_rejected.inc()
            raise
        return submission

    def abort(self, submission: Submission) -> None:
        """Stop routing the submission's unfinished requests and have the engine abort them (frees their
        slots before its next step)."""
        self._dequeue(submission)
        unfinished = [i for i in submission.request_ids if self._consumers.get(i) is submission]
        for request_id in unfinished:
            del self._consumers[request_id]
        if unfinished:
            self.driver.send(AbortCommand(unfinished))

    def fail_in_flight(self, message: str) -> None:
        """Fail every in-flight submission with EngineDeadError(``message``), abort their requests and accept
        no more (the end of a shutdown's drain)."""
        self._fail_all(EngineDeadError(message), True)

    def _dequeue(self, submission: Submission) -> None:
        """The submission's prompts no longer count as queued (idempotent)."""
        self.queued_bytes -= submission.queued_bytes
        submission.queued_bytes = 0

    # --- what the engine loop reports, handled on the event loop --------------------------------------

    def _handle(self, event: Event) -> None:
        if isinstance(event, Stepped):
            for stats in event.steps:
                self.metrics.observe_step(stats)
                self.stat_logger.record(stats, event.load)
                for request_id in stats.latencies.started:  # a request without output until it ends is no
                    submission = self._consumers.get(request_id)  # longer queued once its first token came
                    if submission is not None:
                        self._dequeue(submission)
            self.metrics.observe_outputs(event.outputs)
            self.metrics.set_load(event.load)
            if event.outputs:
                self._route(event.outputs)
        elif isinstance(event, Added):
            accepted, params, count = self._adds.pop(event.add_id)
            if event.error is None:
                for _ in range(count):
                    self.metrics.observe_admitted(params)
            self.metrics.set_load(event.load)
            self._settle(accepted, event.error)
        elif isinstance(event, Aborted):  # those a failed step failed carry its error (counted as errors)
            self.metrics.observe_outputs(event.finals)
            self.metrics.set_load(event.load)
        elif isinstance(event, LoadChanged):
            self.metrics.set_load(event.load)
        elif isinstance(event, StepFailed):  # their clients were answered a 500: their finals carry the error
            self._fail_all(RequestFailedError(event.message), False, event.message)
        else:
            if not self._stopping:  # it died: /health says 503 from now on, and the log and metrics say why
                logger.error("the engine stopped: %s; /health answers 503 from now on", event.message)
                self.metrics.observe_engine_died(len(self._consumers))
            self._fail_all(EngineDeadError(event.message), True)

    def _route(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            submission = self._consumers.get(out.request_id)
            if submission is None:  # aborted since the step started
                continue
            self._dequeue(submission)
            if out.finished:
                del self._consumers[out.request_id]
            submission.put(out)

    @staticmethod
    def _settle(accepted: asyncio.Future[None], error: Exception | None) -> None:
        if accepted.done():  # the submission was cancelled or failed meanwhile
            return
        if error is None:
            accepted.set_result(None)
        else:
            accepted.set_exception(error)

    def _fail_all(self, error: BaseException, closing: bool, abort_error: str | None = None) -> None:
        """Fail every in-flight submission and have the engine abort their requests (after a failed step,
        this command is what the engine loop waits for), their final outputs with ``abort_error``, if given."""
        failed, self._consumers = self._consumers, {}
        self.driver.send(AbortCommand(list(failed), abort_error))
        if closing:
            self._accepting = False
        for submission in set(failed.values()):
            self._dequeue(submission)
            submission.fail(error)
