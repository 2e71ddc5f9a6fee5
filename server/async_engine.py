"""Bridge between the asyncio server and the single-threaded engine.

The engine runs in its own thread (:class:`EngineThread`, which also loads the model) and takes commands
(add, abort, stop) from one queue, blocking on it while it has nothing to do. Each step's outputs cross back
to the event loop in one ``call_soon_threadsafe``, where they are routed to the :class:`Submission` that
consumes each request; the result of an add comes back the same way, on an asyncio future. What the bridge
knows about a request is only which submission consumes it. A request the engine fails
(``RequestOutput.error``) fails its submission alone; if ``engine.step()`` itself raises, every in-flight
request fails and is aborted.

The bridge also bounds the memory that queued requests hold: the prompts of submissions that have not yet
produced an output count against ``max_queued_bytes``. It keeps the Prometheus metrics up to date, logs a
throughput line every 10 s while busy, and says whether the server is ready for requests (``/ready``).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from rnnserve.engine.llm_engine import LLMEngine
from rnnserve.engine.outputs import RequestOutput, merge_deltas
from rnnserve.engine.sampling_params import OutputKind, SamplingParams
from rnnserve.engine.scheduler import QueueFullError
from rnnserve.engine.state_snapshot import StateSnapshot
from rnnserve.server.metrics import ServerMetrics, StatLogger

logger = logging.getLogger("rnnserve.engine")

Prompt = str | list[int]
T = TypeVar("T")
TOKEN_ID_BYTES = 8  # what the engine holds per prompt token id, roughly


def prompt_bytes(prompts: list[Prompt]) -> int:
    """The size of prompts as they wait in the queue: UTF-8 bytes of text, 8 bytes per token id."""
    return sum(len(p.encode()) if isinstance(p, str) else TOKEN_ID_BYTES * len(p) for p in prompts)


class EngineDeadError(RuntimeError):
    """The engine thread is not running (shutting down or stopped)."""


class RequestFailedError(RuntimeError):
    """The engine failed this request alone while processing it."""


@dataclass
class AddCommand:
    """Add one engine request per prompt, all or none; the outcome settles ``accepted``. ``context`` and
    ``return_state`` are passed to every ``add_request``."""

    request_ids: list[str]
    prompts: list[Prompt]
    params: SamplingParams
    arrival_time: float
    accepted: asyncio.Future[None]
    context: StateSnapshot | None = None
    return_state: bool = False


@dataclass
class AbortCommand:
    request_ids: list[str]


@dataclass
class StopCommand:
    pass


Command = AddCommand | AbortCommand | StopCommand


class Submission:
    """The engine requests of one HTTP call: ``request_id`` is the call's (the response's ``id``),
    ``request_ids`` the engine's, one per prompt. Their outputs arrive, interleaved, on one queue.

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
        self.accepted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.on_finished: Callable[[RequestOutput], Awaitable[None]] | None = None
        self.on_close: list[Callable[[], None]] = []
        self._held: RequestOutput | BaseException | None = None  # taken from the queue but not merged

    def has_queued(self) -> bool:
        """Whether an output (or error) is waiting to be read."""
        return self._held is not None or not self.queue.empty()

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        """Yield outputs until every request finished. Raises :class:`RequestFailedError` when the engine
        failed one of them, or the error that failed the whole engine (or what ``on_finished`` raised)."""
        remaining = len(self.request_ids)
        while remaining:
            if self._held is not None:
                item, self._held = self._held, None
            else:
                item = await self.queue.get()
            if self.coalesce:
                item = self._merge_queued(item)
            if isinstance(item, BaseException):
                raise item
            if item.error is not None:
                raise RequestFailedError(item.error)
            remaining -= item.finished
            if item.finished and self.on_finished is not None:
                await self.on_finished(item)
            yield item

    def _merge_queued(self, item: RequestOutput | BaseException) -> RequestOutput | BaseException:
        """``item`` with the outputs queued right behind it for the same request merged in; the first item that
        cannot be merged (another request, an error) is held for the next read."""
        while isinstance(item, RequestOutput) and not item.finished and not self.queue.empty():
            following = self.queue.get_nowait()
            if (
                not isinstance(following, RequestOutput)
                or following.request_id != item.request_id
                or following.error is not None
            ):
                self._held = following
                break
            item = merge_deltas(item, following)
        return item

    def fail(self, error: BaseException) -> None:
        """End the submission with ``error``: before it was accepted, or mid-generation."""
        if self.accepted.done():
            self.queue.put_nowait(error)
        else:
            self.accepted.set_exception(error)

    def abort(self) -> None:
        """Abort whatever has not finished yet and run the ``on_close`` callbacks (idempotent)."""
        self.bridge.abort(self)
        callbacks, self.on_close = self.on_close, []
        for callback in callbacks:
            callback()


class EngineThread:
    """The one thread that does a server's engine work: it loads the model (:meth:`call`), then runs the step
    loop (:meth:`submit`), so warm-up and steps run where the weights were prepared.

    On CPU each thread that runs parallel torch ops gets an OpenMP team of its own. Once a second team exists
    (e.g. that of the thread that loaded the model), libgomp's threads outnumber the cores and its workers
    sleep between parallel regions instead of spinning: batched decode steps ran ~17% slower. A single
    thread keeps a single team. The thread runs torch with as many threads as its creator does."""

    def __init__(self, name: str = "rnnserve-engine") -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._num_threads = torch.get_num_threads()
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        torch.set_num_threads(self._num_threads)
        while (job := self._jobs.get()) is not None:
            job()

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        """Queue ``fn`` for the thread; its future holds the result or the exception."""
        if self._closed:
            raise RuntimeError("the engine thread is closed")
        future: Future[T] = Future()

        def job() -> None:
            try:
                future.set_result(fn())
            except BaseException as err:  # noqa: BLE001 - the caller gets it from the future
                future.set_exception(err)

        self._jobs.put(job)
        return future

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` run on the thread; blocks until it returns (or raises what it raised)."""
        return self.submit(lambda: fn(*args)).result()

    def close(self) -> None:
        """End the thread once its queued jobs ran."""
        self._closed = True
        self._jobs.put(None)


class AsyncEngine:
    """Owns an :class:`LLMEngine` and the thread that drives it (``thread``, the one that built the engine,
    else a new one). Public methods run on the event loop."""

    def __init__(
        self,
        engine: LLMEngine,
        metrics: ServerMetrics,
        max_queued_bytes: int | None = None,
        thread: EngineThread | None = None,
    ) -> None:
        self.engine = engine
        self.metrics = metrics
        self.max_queued_bytes = max_queued_bytes
        self.queued_bytes = 0
        self.draining = False
        self.stat_logger = StatLogger()
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._consumers: dict[str, Submission] = {}
        self._thread = thread or EngineThread()
        self._loop_done: Future[None] | None = None  # the step loop's, while it runs
        self._loop: asyncio.AbstractEventLoop | None = None
        self._accepting = False
        load = engine.load()
        metrics.set_pool(load.num_slots, load.bytes_per_slot)
        metrics.set_load(load)

    @property
    def running(self) -> bool:
        return self._loop_done is not None and not self._loop_done.done()

    def not_ready_reason(self) -> str | None:
        """Why the server cannot take requests now, or ``None`` when it can. An AsyncEngine exists only once
        the model is loaded and, on CPU, the fused kernels are built (``LLMEngine`` does both before it returns),
        so what remains is the engine thread running and the server not shutting down."""
        if self.draining:
            return "the server is shutting down"
        if not self.running or not self._accepting:
            return "the engine is not running"
        return None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._accepting = True
        self._loop_done = self._thread.submit(self._run)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the engine loop and wait for it (bounded), then end its thread; pending requests fail with
        EngineDeadError. Blocks: call it off the event loop."""
        self._commands.put(StopCommand())
        if self._loop_done is not None:
            wait([self._loop_done], timeout)
        self._thread.close()

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
        self._commands.put(
            AddCommand(ids, prompts, params, time.monotonic(), submission.accepted, context, return_state)
        )
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
            self._commands.put(AbortCommand(unfinished))

    def fail_in_flight(self, message: str) -> None:
        """Fail every in-flight submission with EngineDeadError(``message``), abort their requests and accept
        no more (the end of a shutdown's drain)."""
        self._fail_all(EngineDeadError(message), True)

    def _dequeue(self, submission: Submission) -> None:
        """The submission's prompts no longer count as queued (idempotent)."""
        self.queued_bytes -= submission.queued_bytes
        submission.queued_bytes = 0

    # --- event loop side: what the engine thread posts ------------------------------------------------

    def _route(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            submission = self._consumers.get(out.request_id)
            if submission is None:  # aborted since the step started
                continue
            self._dequeue(submission)
            if out.finished:
                del self._consumers[out.request_id]
            submission.queue.put_nowait(out)

    @staticmethod
    def _settle(accepted: asyncio.Future[None], error: Exception | None) -> None:
        if accepted.done():  # the submission was cancelled or failed meanwhile
            return
        if error is None:
            accepted.set_result(None)
        else:
            accepted.set_exception(error)

    def _fail_all(self, error: BaseException, closing: bool) -> None:
        """Fail every in-flight submission and have the engine abort their requests (after a failed step,
        this command is what the engine thread waits for; after a stop, it runs first if the thread restarts)."""
        failed, self._consumers = self._consumers, {}
        self._commands.put(AbortCommand(list(failed)))
        if closing:
            self._accepting = False
        for submission in set(failed.values()):
            self._dequeue(submission)
            submission.fail(error)

    # --- engine thread ---------------------------------------------------------------------------------

    def _run(self) -> None:
        error = EngineDeadError("the server is shutting down")
        try:
            wait = True
            while self._run_commands(wait):
                # Wait for the next command when idle, and after a failed step (the loop answers with aborts).
                wait = not (self.engine.has_unfinished_requests() and self._step())
        except Exception:
            logger.exception("engine thread crashed")
            error = EngineDeadError("the engine stopped after an internal error")
        finally:
            self._post(self._fail_all, error, True)

    def _run_commands(self, wait: bool) -> bool:
        """Execute the queued commands, first waiting for one if ``wait``; False once told to stop."""
        while True:
            try:
                command = self._commands.get(block=wait)
            except queue.Empty:
                return True
            wait = False
            if isinstance(command, StopCommand):
                return False
            if isinstance(command, AddCommand):
                self._add(command)
            else:
                self._abort(command)

    def _add(self, command: AddCommand) -> None:
        error: Exception | None = None
        added: list[str] = []
        try:
            for request_id, prompt in zip(command.request_ids, command.prompts, strict=True):
                self.engine.add_request(
                    prompt,
                    command.params,
                    request_id,
                    command.arrival_time,
                    context=command.context,
                    return_state=command.return_state,
                )
                added.append(request_id)
        except Exception as err:  # all or none: roll back the prompts already added, report the error
            error = err
            for request_id in added:
                self.engine.abort_request(request_id)
        else:
            for _ in added:
                self.metrics.observe_admitted(command.params)
        self.metrics.set_load(self.engine.load())
        self._post(self._settle, command.accepted, error)

    def _abort(self, command: AbortCommand) -> None:
        finals = [out for i in command.request_ids if (out := self.engine.abort_request(i)) is not None]
        self.metrics.observe_outputs(finals)
        self.metrics.set_load(self.engine.load())

    def _step(self) -> bool:
        """One engine step, whose outputs reach the event loop in one batch; False if the step itself raised.
        With async scheduling (a GPU) the step returns once the next one is queued on the device, so the event
        loop streams these outputs while the device computes."""
        try:
            outputs = self.engine.step()
        except Exception as err:
            logger.exception("engine step failed; failing every in-flight request")
            self._post(self._fail_all, RequestFailedError(f"{type(err).__name__}: {err}"), False)
            return False
        load = self.engine.load()
        self.metrics.observe_step(self.engine.last_step, outputs)
        self.metrics.set_load(load)
        self.stat_logger.record(self.engine.last_step, load)
        if outputs:
            self._post(self._route, outputs)
        return True

    def _post(self, callback: Callable[..., None], *args: Any) -> None:
        if self._loop is None:
            return
        try:
            self._loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass
