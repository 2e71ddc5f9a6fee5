"""The engine's side of the server: the loop that drives an :class:`LLMEngine` (:class:`EngineCore`) and the
two places it can run.

* :class:`ThreadDriver`: a thread of the server's process (:class:`EngineThread`). Simple, and right on a CPU,
  where the model step is the host's own work.
* :class:`ProcessDriver`: a process of its own (:class:`EngineProcess`), as vLLM's engine core. On a GPU the
  engine's host work (scheduling, sampling bookkeeping, detokenizing) and the HTTP event loop (routing outputs,
  one SSE write per stream) both need a Python interpreter; in one process they take turns on its lock, and at
  a few hundred streams neither keeps up with the device. The server process then only serves HTTP; the engine
  process only steps the engine, for one server or for several (``--api-servers``; :class:`ServerLinks`).

The loop and the server speak in messages (commands in, events out), the same ones in both places; across
processes they are pickled through a pipe, the server's commands written by a thread of their own
(:class:`CommandSender`). A step's outputs cross as rows of plain data, which the engine process builds straight
from its requests (:class:`OutputEncoder` / :class:`OutputDecoder`: no output objects on the engine's side, and
several times cheaper to pickle than dataclasses, which matters at a few hundred outputs per step), each
carrying its request's prompt (ids, text, prompt logprobs) only the first time, so a long prompt is not pickled
once per generated token, and a stream's outputs between its first and its last as columns: one flat list per
server of each stream's handle, text and token ids, built in one pass over the step's requests, or, for a steady
batch's streams, one block per server of the batch's kept steps as it kept them (no list per stream). The loop
posts a step's outputs only while the server has handled all but one of those it posted before
(:class:`EngineCore`), so a busy server gets fewer, larger messages; with several servers each has that window
of its own (:class:`ServerLinks`), so one that stalls holds back its own requests' outputs only.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import math
import multiprocessing
import operator
import os
import pickle
import queue
import select
import signal
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import torch

from rnnserve.engine.config import EngineConfig
from rnnserve.engine.llm_engine import (
    EngineLoad,
    LLMEngine,
    StepStats,
    exit_process,
    freeze_startup_heap,
    retain_freed_memory,
)
from rnnserve.engine.model_sources import ModelLoadError
from rnnserve.engine.models.base import StateSpec
from rnnserve.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput, TokenLogprob
from rnnserve.engine.sampling_params import OutputKind, SamplingParams
from rnnserve.engine.scheduler import QueueFullError
from rnnserve.engine.sequence import Sequence as Sample
from rnnserve.engine.sequence import SequenceGroup, SteadyAppend, take_stream_deltas
from rnnserve.engine.state_snapshot import StateSnapshot
from rnnserve.engine.structured_output import CompiledGrammar
from rnnserve.engine.tokenizer import Tokenizer

if TYPE_CHECKING:
    from rnnserve.server.config import ServerConfig

logger = logging.getLogger("rnnserve.engine")

Prompt = str | list[int]
OutputRow = tuple  # one RequestOutput as plain data (see OutputEncoder)
# The compact outputs of a step per server (None: requests without one, as outside an engine process): for each
# stream, its handle, text delta and new token ids, one after the other in one flat list, where a steady batch's
# streams take three entries together: their handles, the kept steps' token lists and their text lists (see
# OutputEncoder)
DeltaColumns = dict[int | None, list[Any]]
T = TypeVar("T")
EngineFactory = Callable[[EngineConfig], LLMEngine]
SHUTDOWN_MESSAGE = "the server is shutting down"
# Stepped events the server may hold unhandled: one it handles and the next, ready when it is done (one alone
# would make it wait for the end of the engine's step after each).
MAX_UNHANDLED = 2
# How long an engine loop with nothing to step waits for a compiling grammar before it looks for commands again.
GRAMMAR_WAIT_SECONDS = 0.005
DEFAULT_MAX_COMPILING = 256  # adds whose structured output waits to compile, or compiles (--max-compiling)
DEFAULT_STALL_TIMEOUT = 30.0  # seconds (--api-server-stall-timeout)
STOPPED_DELIVERY_SECONDS = 5.0  # how long an engine process that ends waits for its servers to read their last bytes


@dataclass(frozen=True)
class LoopLimits:
    """The engine loop's own limits, set by ``rnnserve serve``'s flags: ``max_compiling`` adds whose structured
    output waits to compile (or compiles), beyond which an add is refused (a 429); ``stall_timeout`` the seconds an
    API server of an engine process may leave the outputs it was sent unacknowledged, or unread, before it is
    taken for stalled (``None``: never; see :class:`ServerLinks`)."""

    max_compiling: int = DEFAULT_MAX_COMPILING
    stall_timeout: float | None = DEFAULT_STALL_TIMEOUT

    @classmethod
    def of(cls, config: ServerConfig) -> LoopLimits:
        return cls(config.max_compiling, config.api_server_stall_timeout or None)


@dataclass(frozen=True)
class EngineInfo:
    """What the server needs to know about its engine, wherever the engine runs: the tokenizer, the limits,
    the state pool and the model's identity (for sessions)."""

    tokenizer: Tokenizer
    vocab_size: int
    max_model_len: int
    model_fingerprint: str
    state_specs: list[StateSpec]
    num_slots: int
    bytes_per_slot: int
    device: str
    dtype: str
    load: EngineLoad

    @classmethod
    def of(cls, engine: LLMEngine) -> EngineInfo:
        weight = next(iter(engine.model.parameters()), None)
        return cls(
            tokenizer=engine.tokenizer,
            vocab_size=engine.model.vocab_size,
            max_model_len=engine.max_model_len,
            model_fingerprint=engine.model_fingerprint,
            state_specs=engine.state_specs,
            num_slots=engine.pool.num_slots,
            bytes_per_slot=engine.pool.bytes_per_slot,
            device=str(engine.device),
            dtype=str(weight.dtype).removeprefix("torch.") if weight is not None else "none",
            load=engine.load(),
        )


# --- commands (server -> engine) -------------------------------------------------------------------------


@dataclass
class AddCommand:
    """Add one engine request per prompt, all or none; :class:`Added` with the same ``add_id`` answers it."""

    add_id: int
    request_ids: list[str]
    prompts: list[Prompt]
    params: SamplingParams
    arrival_time: float
    context: StateSnapshot | None = None
    return_state: bool = False


@dataclass
class AbortCommand:
    """Abort these requests; ``error``, when given, is why, which their final outputs (:class:`Aborted`) carry
    unless they have an error of their own (the metrics then count them as errors, not aborts)."""

    request_ids: list[str]
    error: str | None = None


@dataclass
class HandledCommand:
    """The server handled a :class:`Stepped`: the engine loop may post it another."""


@dataclass
class StopCommand:
    pass


Command = AddCommand | AbortCommand | HandledCommand | StopCommand


# --- events (engine -> server) ---------------------------------------------------------------------------


@dataclass
class Added:
    """The outcome of an :class:`AddCommand` (its ``request_ids``): ``error`` is what ``add_request`` or the
    compiling of its structured output raised (nothing was added)."""

    add_id: int
    request_ids: list[str]
    error: Exception | None
    load: EngineLoad


@dataclass
class Aborted:
    """Requests aborted on the server's command, with their final outputs (for metrics)."""

    finals: list[RequestOutput]
    load: EngineLoad


@dataclass
class LoadChanged:
    """The engine's load after another API server's add or abort (``--api-servers``): every server's gauges
    follow the engine, not only those of the server whose command changed it."""

    load: EngineLoad


@dataclass
class Stepped:
    """Engine steps and their outputs: one step, or the steps run while the server handled the previous
    :class:`Stepped` (each request's output then covers them all); ``steps`` has each step's stats. In the
    engine process the outputs are already the rows they cross as (:meth:`OutputEncoder.row`), and the compact
    outputs of streams the columns of each server in ``deltas`` (:meth:`OutputEncoder.take_deltas`)."""

    outputs: list[RequestOutput] | list[OutputRow]
    steps: list[StepStats]
    load: EngineLoad
    deltas: DeltaColumns | None = None


@dataclass
class StepFailed:
    """``engine.step()`` raised: every in-flight request fails; the loop waits for the server's aborts."""

    message: str


@dataclass
class Stopped:
    """The loop ended (stopped, crashed, or its process died); ``message`` says why."""

    message: str


@dataclass
class LoadFailed:
    """The engine process could not build its engine."""

    error: Exception


Event = Added | Aborted | LoadChanged | Stepped | StepFailed | Stopped


def portable_error(error: Exception) -> Exception:
    """``error`` if it survives pickling, else a RuntimeError with its type and message."""
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:  # noqa: BLE001 - any failure means it cannot cross
        return RuntimeError(f"{type(error).__name__}: {error}")
    return error


@dataclass
class CompilingAdd:
    """An :class:`AddCommand` whose structured output compiles on the grammar thread (``grammar``)."""

    command: AddCommand
    grammar: Future[CompiledGrammar]


class OutputFlow(Protocol):
    """Flow control of the outputs :class:`EngineCore` posts: which server may take a :class:`Stepped` now."""

    def has_room(self) -> bool:
        """Whether a server may take a :class:`Stepped` now."""
        ...

    def wanted(self) -> Callable[[SequenceGroup], bool] | None:
        """Which requests' outputs it may carry (those whose server has room; ``None``: all); the others wait,
        uncollected."""
        ...

    def handled(self, command: HandledCommand) -> None:
        """A server handled a :class:`Stepped` (the loop runs ``command``)."""
        ...


class OutputWindow:
    """The :class:`OutputFlow` of one server: ``post`` that counts the :class:`Stepped` events it posts, at most
    :data:`MAX_UNHANDLED` of them not handled yet."""

    def __init__(self, post: Callable[[Event], None]) -> None:
        self._post = post
        self.unhandled = 0  # Stepped events posted and not handled by the server yet

    def post(self, event: Event) -> None:
        if isinstance(event, Stepped):
            self.unhandled += 1
        self._post(event)

    def has_room(self) -> bool:
        return self.unhandled < MAX_UNHANDLED

    def wanted(self) -> None:
        return None

    def handled(self, command: HandledCommand) -> None:
        self.unhandled -= 1


class EngineCore:
    """Drives an :class:`LLMEngine`: runs the commands ``next_command(block)`` returns (``None``: none
    queued), steps while requests are unfinished, blocks for a command when idle, and reports each outcome
    through ``post``. One instance per engine; :meth:`run` ends with a :class:`Stopped` event.

    An add with a structured output is answered once its grammar compiled, on a thread of its own (llguidance
    releases the GIL meanwhile): the loop keeps stepping the other requests. Compiled on the loop, a schema of
    8000 objects stalled every stream for 3-4 s. An invalid grammar is the add's error (a 400), as before, and
    an abort of a request whose grammar still compiles drops its add. At most ``max_compiling`` adds wait for
    their grammars: one more is refused (``QueueFullError``, a 429). The requests that wait for their grammars
    count as waiting in the load the loop posts (and as ``num_compiling``).

    Outputs flow with at most :data:`MAX_UNHANDLED` messages in flight per server (``flow``; by default one
    server, :class:`OutputWindow`): once that many :class:`Stepped` are posted, the loop builds the next one only
    after the server says (:class:`HandledCommand`) that it handled one. Steps run meanwhile collect nothing; the
    next collection builds each request's output once for all of them (``LLMEngine.step``). So a server that falls
    behind the device costs the engine one output per request per message, not per step, and its streams send
    several tokens a chunk, instead of the engine slowing down to build and send outputs that queue up. With
    several servers (:class:`ServerLinks`) a message collects the requests of the servers with room only: one
    that falls behind, or stalls, leaves the others' outputs flowing. ``build`` makes each output a
    :class:`Stepped` carries from its request; an engine process's ``encoder`` first takes the compact outputs of
    streams, in bulk (:meth:`OutputEncoder.take_deltas`), which the :class:`Stepped` carries as its ``deltas``."""

    def __init__(
        self,
        engine: LLMEngine,
        next_command: Callable[[bool], Command | None],
        post: Callable[[Event], None],
        build: Callable[[SequenceGroup], RequestOutput] | Callable[[SequenceGroup], OutputRow] = SequenceGroup.output,
        flow: OutputFlow | None = None,
        max_compiling: int = DEFAULT_MAX_COMPILING,
        encoder: OutputEncoder | None = None,
    ) -> None:
        self.engine = engine
        self.encoder = encoder
        self.next_command = next_command
        if flow is None:
            flow = window = OutputWindow(post)
            post = window.post
        self.post = post
        self.build = build
        self.flow = flow
        self.steps: list[StepStats] = []  # the stats of the steps not posted yet
        self.grammar_thread = ThreadPoolExecutor(1, thread_name_prefix="rnnserve-grammar")
        self.compiling: list[CompilingAdd] = []
        self.max_compiling = max_compiling

    def run(self) -> None:
        message = SHUTDOWN_MESSAGE
        try:
            wait_for_command = True
            while self._run_commands(wait_for_command and not self.compiling):
                # Wait for the next command when idle, after a failed step (the server answers with aborts), and
                # while the last steps' outputs wait for the server to handle the previous ones; while a grammar
                # compiles, wait for it instead, looking for commands every few milliseconds.
                if wait_for_command and self.compiling:
                    wait([c.grammar for c in self.compiling], GRAMMAR_WAIT_SECONDS, FIRST_COMPLETED)
                self._add_compiled()
                if self.engine.has_unfinished_requests():
                    wait_for_command = not self._step()
                else:
                    self._post_outputs_if_room()
                    wait_for_command = True
        except Exception:
            logger.exception("engine loop crashed")
            message = "the engine stopped after an internal error"
        finally:
            self.grammar_thread.shutdown(wait=False, cancel_futures=True)
            self.post(Stopped(message))

    def _run_commands(self, block: bool) -> bool:
        """Execute the queued commands, first waiting for one if ``block``; False once told to stop."""
        queued_compiles = False
        while (command := self.next_command(block)) is not None:
            block = False
            if isinstance(command, StopCommand):
                return False
            if isinstance(command, HandledCommand):
                self.flow.handled(command)
            elif isinstance(command, AddCommand):
                if command.params.structured_outputs is None:
                    self._add(command)
                else:
                    queued_compiles |= self._compile(command)
            else:
                self._drop_compiling(command.request_ids)
                finals = [out for i in command.request_ids if (out := self.engine.abort_request(i)) is not None]
                if command.error is not None:
                    for out in finals:
                        out.error = out.error or command.error
                self.post(Aborted(finals, self._load()))
        if queued_compiles:  # the gauges count them as waiting now, not once their grammars compiled
            self.post(LoadChanged(self._load()))
        return True

    def _compile(self, command: AddCommand) -> bool:
        """Compile the add's structured output on the grammar thread (one at a time); it is added once that is
        done (:meth:`_add_compiled`). Refused (``QueueFullError``) while ``max_compiling`` adds wait for theirs;
        whether it was queued."""
        if len(self.compiling) >= self.max_compiling:
            waiting = len(self.compiling)
            error = QueueFullError(f"{waiting} structured outputs wait to compile (--max-compiling {waiting})")
            self.post(Added(command.add_id, command.request_ids, error, self._load()))
            return False
        grammar = self.grammar_thread.submit(self.engine.grammars.compile, command.params.structured_outputs)
        self.compiling.append(CompilingAdd(command, grammar))
        return True

    def _load(self) -> EngineLoad:
        """The engine's load, with the requests whose grammars compile counted as waiting."""
        load = self.engine.load()
        if not self.compiling:
            return load
        compiling = sum(len(c.command.request_ids) for c in self.compiling)
        return dataclasses.replace(load, num_waiting=load.num_waiting + compiling, num_compiling=compiling)

    def _add_compiled(self) -> None:
        """Answer the adds whose grammars are compiled: add their requests, or report why the grammar failed."""
        for ready in [c for c in self.compiling if c.grammar.done()]:
            self.compiling.remove(ready)
            command = ready.command
            try:
                grammar = ready.grammar.result()
            except Exception as err:  # noqa: BLE001 - the add's error, e.g. an invalid schema (a 400)
                self.post(Added(command.add_id, command.request_ids, err, self._load()))
            else:
                self._add(command, grammar)

    def _drop_compiling(self, request_ids: list[str]) -> None:
        """Drop the adds still compiling that the aborted requests belong to (their server has given up on them;
        it is told, so that it stops waiting for their answers)."""
        aborted = set(request_ids)
        for dropped in [c for c in self.compiling if aborted.intersection(c.command.request_ids)]:
            self.compiling.remove(dropped)
            dropped.grammar.cancel()
            error = RuntimeError("aborted while its structured output compiled")
            self.post(Added(dropped.command.add_id, dropped.command.request_ids, error, self._load()))

    def _add(self, command: AddCommand, grammar: CompiledGrammar | None = None) -> None:
        """Add the command's requests, all or none (``grammar``: their structured output, compiled).

        The error is posted from its ``except`` block, whose end unbinds it: kept in a local of this frame, which
        its traceback holds, it made a cycle that kept the failed request (``add_request``'s frame) alive until a
        full collection."""
        added: list[str] = []
        try:
            with self.engine.one_answer():
                for request_id, prompt in zip(command.request_ids, command.prompts, strict=True):
                    self.engine.add_request(
                        prompt,
                        command.params,
                        request_id,
                        command.arrival_time,
                        context=command.context,
                        return_state=command.return_state,
                        grammar=grammar,
                    )
                    added.append(request_id)
        except Exception as err:  # all or none: roll back the prompts already added, report the error
            for request_id in added:
                self.engine.abort_request(request_id)
            self.post(Added(command.add_id, command.request_ids, err, self._load()))
            return
        self.post(Added(command.add_id, command.request_ids, None, self._load()))

    def _step(self) -> bool:
        """One engine step, its outputs posted now or (while their server holds :data:`MAX_UNHANDLED` unhandled)
        with a later step's; False if the step itself raised. With async scheduling (a GPU) the step returns once the
        next one is queued on the device, so its outputs are built and sent meanwhile."""
        try:
            self.engine.step(collect=False)
        except Exception as err:
            logger.exception("engine step failed; failing every in-flight request")
            if self._has_unposted():  # what earlier steps finished still reaches its clients
                self._post_outputs(self._collect(None))
            self.post(StepFailed(f"{type(err).__name__}: {err}"))
            return False
        self.steps.append(self.engine.last_step)
        self._post_outputs_if_room()
        return True

    def _has_unposted(self) -> bool:
        return bool(self.steps) or self.engine.has_uncollected_outputs

    def _post_outputs_if_room(self) -> None:
        """Post the outputs of the requests whose servers have room, with the steps' stats; nothing when there
        are neither (what waits is another server's)."""
        if self.flow.has_room() and self._has_unposted():
            outputs = self._collect(self.flow.wanted())
            if outputs or self.steps or (self.encoder is not None and self.encoder.columns):
                self._post_outputs(outputs)

    def _collect(self, wanted: Callable[[SequenceGroup], bool] | None) -> list[RequestOutput] | list[OutputRow]:
        """The outputs of the requests ``wanted`` accepts; the compact ones go to the encoder's columns."""
        bulk = self.encoder.take_deltas if self.encoder is not None else None
        return self.engine.collect(self.build, wanted, bulk)

    def _post_outputs(self, outputs: list[RequestOutput] | list[OutputRow]) -> None:
        steps, self.steps = self.steps, []
        deltas = self.encoder.take_columns() if self.encoder is not None else None
        self.post(Stepped(outputs, steps, self._load(), deltas))


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

    def join(self, timeout: float) -> None:
        """Wait (bounded) for the thread to end after :meth:`close`: until then it holds its last job."""
        self._thread.join(timeout)


EventHandler = Callable[[Event], None]


def post_to(loop: asyncio.AbstractEventLoop, handle: EventHandler) -> EventHandler:
    """A ``post`` that runs ``handle(event)`` on ``loop`` (dropped once the loop is closed)."""

    def post(event: Event) -> None:
        try:
            loop.call_soon_threadsafe(handle, event)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    return post


def acknowledging(handle: EventHandler, send: Callable[[Command], None]) -> EventHandler:
    """``handle`` that, once it handled a :class:`Stepped`, tells the engine loop so (see :class:`EngineCore`)."""

    def handle_then_acknowledge(event: Event) -> None:
        try:
            handle(event)
        finally:
            if isinstance(event, Stepped):
                send(HandledCommand())

    return handle_then_acknowledge


class ThreadDriver:
    """Runs the engine loop on an :class:`EngineThread` of this process; ``engine`` is the live engine (``None``
    once stopped)."""

    def __init__(self, engine: LLMEngine, thread: EngineThread | None = None, limits: LoopLimits | None = None) -> None:
        self.engine: LLMEngine | None = engine
        self.info = EngineInfo.of(engine)
        self.thread = thread or EngineThread()
        self.limits = limits or LoopLimits()
        self.commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._done: Future[None] | None = None

    @property
    def running(self) -> bool:
        return self._done is not None and not self._done.done()

    def start(self, loop: asyncio.AbstractEventLoop, handle: EventHandler) -> None:
        if self.engine is None:
            raise RuntimeError("the engine was stopped")
        post = post_to(loop, acknowledging(handle, self.send))
        core = EngineCore(self.engine, self._next_command, post, max_compiling=self.limits.max_compiling)
        self._done = self.thread.submit(core.run)

    def _next_command(self, block: bool) -> Command | None:
        try:
            return self.commands.get(block=block)
        except queue.Empty:
            return None

    def send(self, command: Command) -> None:
        self.commands.put(command)

    def stop(self, timeout: float) -> None:
        """Stop the loop and wait for it (bounded), then end the thread and let go of the engine: an app's routes
        outlive its server in FastAPI's caches of endpoint callables (thousands of entries, process-wide), and
        through them its driver, which kept the engine (weights, state pool, prefix-cache tier) alive."""
        self.send(StopCommand())
        if self._done is not None:
            wait([self._done], timeout)
        self.thread.close()
        if self._done is None or self._done.done():
            self.thread.join(timeout)  # nothing left to run: it ends at once
        self.engine = None


metrics_fields = operator.attrgetter(*(f.name for f in dataclasses.fields(RequestMetrics)))


# where CompletionOutput.num_tokens sits in Sequence.take_output_fields' tuple (the fields in order)
NUM_TOKENS_FIELD = [f.name for f in dataclasses.fields(CompletionOutput)].index("num_tokens")


class OutputEncoder:
    """Engine side: each request's output as a row of plain data, built straight from the request (no output
    objects in between: at a few hundred streams that halves the engine's cost of an output), which pickles
    several times faster than dataclass instances, and without the prompt (text, ids, logprobs) after a
    request's first output.

    A stream's outputs between its first and its last, the bulk of a server's traffic, are mostly of one
    sample without logprobs: those are compact, what the step added and nothing else, and the decoder fills in
    the rest from what it kept. They are built all at once (:meth:`take_deltas`, ``bulk`` of
    ``LLMEngine.collect``) into columns, one flat list per server (``owners``: request id -> its server) of
    ``handle, text, token_ids`` after one another, where the handle is a number the request's first full row
    gave it: no tuple or request id per output, and one pass over the step's requests that routes them too. The
    streams of a steady batch whose steps it keeps for the batch (``SteadyAppend``) take no pass at all: their
    outputs are one block per server, ``handles, token_steps, text_steps``, each step's lists as the batch kept
    them (:meth:`StreamPlan._take_kept`)."""

    def __init__(self, owners: dict[str, int] | None = None) -> None:
        self.owners = owners if owners is not None else {}
        self.sent: set[str] = set()  # requests whose prompt crossed
        self.compact: dict[str, tuple[int | None, int]] = {}  # ...of which these: (their server, their handle)
        self.columns: DeltaColumns = {}  # the compact outputs taken since the last take_columns
        self._handles = itertools.count()
        # The requests of the previous take when all of them were compact (a steady batch's streams are the same
        # requests every step), and, once they came twice, their samples and handles per server (StreamPlan).
        self._all_compact: list[SequenceGroup] | None = None
        self._plan: StreamPlan | None = None

    def row(self, group: SequenceGroup) -> OutputRow:
        """``group.output()`` as a row (:class:`OutputDecoder` turns it back into that output)."""
        request_id = group.request_id
        finished = group.finished
        if request_id in self.sent:
            prompt = None
        else:
            prompt = (group.prompt, group.prompt_token_ids, group.prompt_logprobs)
        params = group.params
        handle = None
        if finished:
            self.sent.discard(request_id)
            self.compact.pop(request_id, None)
        else:
            self.sent.add(request_id)
            if params.output_kind is OutputKind.DELTA and len(group.seqs) == 1 and group.seqs[0].logprobs is None:
                key = self.compact.get(request_id)
                if key is None:
                    key = self.compact[request_id] = (self.owners.get(request_id), next(self._handles))
                handle = key[1]
        samples = [seq.take_output_fields(params.output_kind) for seq in group.seqs]
        return (request_id, prompt, samples, finished, metrics_fields(group.metrics), group.error,
                group.num_cached_tokens, group.final_state, group.error_param, handle)  # fmt: skip

    def take_deltas(
        self, groups: list[SequenceGroup], wanted: Callable[[SequenceGroup], bool] | None = None
    ) -> list[SequenceGroup]:
        """Append the compact outputs among ``groups`` (streams past their first output that have not ended: a
        request that failed has ended too) of the requests ``wanted`` accepts (all when ``None``) to their servers'
        columns; returns the other requests, in order.

        When ``groups`` are the requests of the previous take, which were all compact, and none has ended since
        (a steady batch's streams), each server's outputs are taken in one pass over its streams
        (:class:`StreamPlan`), without looking each request up; a server whose requests ``wanted`` refuses (one that
        is behind) has its streams returned, and the others' are taken as ever."""
        if groups and groups == self._all_compact:
            plan = self._plan
            if plan is None or plan.groups is not self._all_compact:
                plan = self._plan = StreamPlan(self._all_compact, self.compact)
            if not any(map(FINISH_REASON, plan.seqs)):
                return plan.take(self.columns, wanted)
        self._all_compact = self._plan = None
        compact = self.compact
        columns = self.columns
        rest = []
        all_compact = True
        for group in groups:
            key = compact.get(group.request_id)
            if key is None:
                rest.append(group)
                all_compact = False
                continue
            seq = group.seqs[0]
            if seq.finish_reason is not None:  # its last output: a full row
                rest.append(group)
                all_compact = False
                continue
            if wanted is not None and not wanted(group):  # its server is behind: taken later
                rest.append(group)
                continue
            owner, handle = key
            column = columns.get(owner)
            if column is None:
                column = columns[owner] = []
            column.append(handle)
            column += seq.take_delta()
        if all_compact:
            self._all_compact = groups
        return rest

    def take_columns(self) -> DeltaColumns:
        """The columns :meth:`take_deltas` filled since the last call."""
        columns, self.columns = self.columns, {}
        return columns

    def forget(self, request_ids: list[str]) -> None:
        self.sent.difference_update(request_ids)
        self._all_compact = self._plan = None
        for request_id in request_ids:
            self.compact.pop(request_id, None)


FINISH_REASON = operator.attrgetter("finish_reason")


class StreamPlan:
    """The streams of compact requests ``groups`` (each one sample), grouped by server: ``by_server`` holds each
    server's requests, samples, handles and the samples' positions in ``seqs`` (all the samples, in the requests'
    order).

    When the samples are a steady batch's, in its order, that keeps its steps' tokens and texts for the batch
    (``SteadyAppend.streaming``), their deltas are those steps' (``SteadyAppend.take_kept``), taken without a pass
    over the samples once every sample has emitted what it held (the first take after the batch settled takes each
    sample's delta, which makes it so); the samples' emitted positions move when the batch settles. Each server's
    streams are a part of the batch (``SteadyAppend.split``) that takes its kept steps on its own: a server that is
    behind leaves its streams' steps kept, and the others' go on as blocks; it takes them all once it catches up."""

    def __init__(self, groups: list[SequenceGroup], compact: dict[str, tuple[int | None, int]]) -> None:
        self.groups = groups
        self.seqs = [group.seqs[0] for group in groups]
        by_server: dict[int | None, ServerStreams] = {}
        for position, (group, seq) in enumerate(zip(groups, self.seqs, strict=True)):
            owner, handle = compact[group.request_id]
            streams = by_server.get(owner)
            if streams is None:
                streams = by_server[owner] = ServerStreams(owner, len(by_server))
            streams.groups.append(group)
            streams.seqs.append(seq)
            streams.handles.append(handle)
            streams.positions.append(position)
        self.by_server = list(by_server.values())
        for streams in self.by_server:
            streams.pick = position_picker(streams.positions, len(self.seqs))
        # each sample's part of the batch: its server's
        self.part_of = None if len(self.by_server) == 1 else [by_server[compact[g.request_id][0]].part for g in groups]
        self._batch: SteadyAppend | None = None  # the steady batch whose samples are ``seqs``, in their order

    def take(self, columns: DeltaColumns, wanted: Callable[[SequenceGroup], bool] | None = None) -> list[SequenceGroup]:
        """Append each stream's delta to its server's column (none of them has ended), but for the servers whose
        requests ``wanted`` refuses; returns those requests."""
        batch = self.seqs[0]._appender
        if batch is not None and batch is not self._batch and batch.streaming and batch.seqs == self.seqs:
            self._batch = batch
            batch.split(self.part_of, len(self.by_server))
        steady = batch is not None and batch is self._batch
        left: list[SequenceGroup] = []
        for streams in self.by_server:
            if wanted is not None and not wanted(streams.groups[0]):
                left += streams.groups
                continue
            column = columns.get(streams.owner)
            if column is None:
                column = columns[streams.owner] = []
            if steady and batch.steps:  # type: ignore[union-attr]
                if batch.emitted_all[streams.part]:  # type: ignore[union-attr]
                    self._take_kept(batch, streams, column)  # type: ignore[arg-type]
                    continue
                batch.settle()  # type: ignore[union-attr]
            take_stream_deltas(streams.seqs, streams.handles, column)
            if steady:
                batch.emitted_all[streams.part] = True  # type: ignore[union-attr]  # each of its samples, just now
        return left

    @staticmethod
    def _take_kept(batch: SteadyAppend, streams: ServerStreams, column: list[Any]) -> None:
        """The deltas of the steps ``batch`` kept that the server did not take yet, as one block ``handles,
        token_steps, text_steps`` into its column: the steps' lists as the batch kept them, no list per stream
        (several servers: the server's streams picked out of each step)."""
        token_steps, text_steps = batch.take_kept(streams.part)
        pick = streams.pick
        if pick is not None:
            token_steps, text_steps = list(map(pick, token_steps)), list(map(pick, text_steps))
        column += (streams.handles, token_steps, text_steps)


@dataclass(slots=True)
class ServerStreams:
    """One server's streams in a :class:`StreamPlan`: its requests, their samples and handles, the samples'
    positions in the plan, the function that picks their entries out of a step's list (``None``: all are its), and
    its part of the steady batch (``SteadyAppend.split``)."""

    owner: int | None
    part: int
    groups: list[SequenceGroup] = field(default_factory=list)
    seqs: list[Sample] = field(default_factory=list)
    handles: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    pick: Callable[[Sequence[Any]], Sequence[Any]] | None = None


def position_picker(positions: list[int], size: int) -> Callable[[Sequence[T]], Sequence[T]] | None:
    """A function that picks the entries at ``positions`` out of a list of ``size``, as a sequence (``None`` when
    they are all of it, in order)."""
    if len(positions) == size:
        return None
    if len(positions) == 1:
        position = positions[0]
        return lambda entries: (entries[position],)
    return operator.itemgetter(*positions)


@dataclass(slots=True)
class KnownRequest:
    """What :class:`OutputDecoder` keeps of a request between its full rows: its prompt, the tokens it has
    generated, its metrics and cached tokens as of its latest full row, and its handle (``None``: no compact
    outputs)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[TokenLogprob | None] | None
    num_tokens: int
    metrics: RequestMetrics
    num_cached_tokens: int
    handle: int | None


class OutputDecoder:
    """Server side: rows and columns back into :class:`RequestOutput` objects, each with its request's prompt,
    token count, metrics and cached tokens kept from its latest full row until it finishes. An output decoded
    from a compact one carries the metrics of that full row: the server reads the metrics of finished outputs
    only."""

    def __init__(self) -> None:
        self.known: dict[str, KnownRequest] = {}
        self.streams: dict[int, KnownRequest] = {}  # the known requests that have a handle, by handle

    def decode(self, rows: list[OutputRow], deltas: Sequence[Any] = ()) -> list[RequestOutput]:
        """The outputs of full ``rows``, then those of the compact ``deltas`` (one server's column)."""
        outputs = []
        known_requests = self.known
        for row in rows:
            request_id, prompt, samples, finished, times, error, num_cached, final_state, error_param, handle = row
            if prompt is None:
                known = known_requests[request_id]
                prompt = (known.prompt, known.prompt_token_ids, known.prompt_logprobs)
            metrics = RequestMetrics(*times)
            text, token_ids, logprobs = prompt
            if finished:
                self.forget([request_id])
            else:
                num_tokens = samples[0][NUM_TOKENS_FIELD] if samples else 0
                known = known_requests[request_id] = KnownRequest(request_id, text, token_ids, logprobs, num_tokens,
                                                                  metrics, num_cached, handle)  # fmt: skip
                if handle is not None:
                    self.streams[handle] = known
            completions = [CompletionOutput(*fields) for fields in samples]
            outputs.append(RequestOutput(request_id, text, token_ids, completions, finished, metrics, error, logprobs,
                                         num_cached, final_state, error_param))  # fmt: skip
        column = iter(deltas)
        streams = self.streams
        for first, second, third in zip(column, column, column, strict=True):
            if first.__class__ is not int:  # a block: handles, tokens per step, texts per step
                self._decode_block(first, second, third, outputs)
                continue
            known = streams[first]  # one stream's: handle, text, token ids
            known.num_tokens += len(third)
            sample = CompletionOutput(0, second, third, None, None, 0.0, second, third, [], known.num_tokens)
            outputs.append(RequestOutput(known.request_id, known.prompt, known.prompt_token_ids, [sample], False,
                                         known.metrics, None, known.prompt_logprobs,
                                         known.num_cached_tokens))  # fmt: skip
        return outputs

    def _decode_block(self, handles: Sequence[int], token_steps: Sequence[Sequence[int]],
                      text_steps: Sequence[Sequence[str]], outputs: list[RequestOutput]) -> None:  # fmt: skip
        """Append the outputs of a block of steady steps' compact deltas (:meth:`StreamPlan._take_kept`) to
        ``outputs``: each stream's tokens and texts of the steps, in order."""
        if len(token_steps) == 1:
            texts: Sequence[str] = text_steps[0]
            token_ids = [[token] for token in token_steps[0]]
        else:
            texts = list(map("".join, zip(*text_steps, strict=True)))
            token_ids = list(map(list, zip(*token_steps, strict=True)))
        streams = self.streams
        for handle, text, tokens in zip(handles, texts, token_ids, strict=True):
            known = streams[handle]
            known.num_tokens += len(tokens)
            sample = CompletionOutput(0, text, tokens, None, None, 0.0, text, tokens, [], known.num_tokens)
            outputs.append(RequestOutput(known.request_id, known.prompt, known.prompt_token_ids, [sample], False,
                                         known.metrics, None, known.prompt_logprobs,
                                         known.num_cached_tokens))  # fmt: skip

    def decode_step(self, step: EncodedStep) -> list[RequestOutput]:
        """The outputs an :class:`EncodedStep` carries."""
        return self.decode(step.rows, step.deltas)

    def forget(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            known = self.known.pop(request_id, None)
            if known is not None and known.handle is not None:
                del self.streams[known.handle]


@dataclass
class EncodedStep:
    """:class:`Stepped` as it crosses between processes: the full rows and this server's column of compact
    outputs (:class:`OutputEncoder`)."""

    rows: list[OutputRow]
    steps: list[StepStats]
    load: EngineLoad
    deltas: list[Any] = field(default_factory=list)


# Connection.send_bytes' framing, which the server's recv_bytes reads and Inbox reads: a 4-byte length (or -1, then
# 8 bytes), then the message's bytes
SMALL_FRAME = 16384  # up to this size a message's header and bytes go out as one write, as send_bytes does
SEND_FLAGS = socket.MSG_DONTWAIT | getattr(socket, "MSG_NOSIGNAL", 0)
FRAME_LENGTH = struct.Struct("!i")
LONG_FRAME_LENGTH = struct.Struct("!Q")  # after a length of -1: a message of 2 GiB or more
INBOX_SIZE = 65536  # bytes an Inbox reads at most at once, unless a message it has begun is larger


class Outbox:
    """What the engine process sends one API server, written without ever blocking the engine loop: the bytes its
    pipe cannot take now wait here, in order, and go out as the server reads (:meth:`flush`). A server stopped
    halfway through reading a large message, or not reading at all, so holds back its own messages, never the
    loop (a blocking ``send_bytes`` stopped every server's streams). Messages are framed as
    ``Connection.send_bytes`` frames them; the server reads them with ``recv_bytes``."""

    def __init__(self, conn: Connection) -> None:
        # A second handle on the pipe's socket: the loop writes through it with MSG_DONTWAIT, a flag of each
        # write, while the connection itself stays blocking for the loop's reads.
        self.socket = socket.socket(fileno=os.dup(conn.fileno()))
        self.socket.settimeout(None)
        self.chunks: deque[bytes | memoryview] = deque()

    @property
    def pending(self) -> bool:
        """Whether bytes wait for the server to read what was written before them."""
        return bool(self.chunks)

    def put(self, payload: bytes) -> int:
        """Queue one message and write what the pipe takes now (see :meth:`flush`)."""
        size = len(payload)
        if size > 0x7FFFFFFF:
            self.chunks.extend((struct.pack("!iQ", -1, size), payload))
        elif size > SMALL_FRAME:
            self.chunks.extend((struct.pack("!i", size), payload))
        elif self.chunks:
            self.chunks.append(struct.pack("!i", size) + payload)
        else:  # the usual case: one write, nothing left
            frame = struct.pack("!i", size) + payload
            try:
                sent = self.socket.send(frame, SEND_FLAGS)
            except BlockingIOError:
                sent = 0
            if sent < len(frame):
                self.chunks.append(memoryview(frame)[sent:])
            return sent
        return self.flush()

    def flush(self) -> int:
        """Write what the pipe takes now, without waiting; the bytes written. Raises OSError once the server's end
        is closed."""
        written = 0
        chunks = self.chunks
        while chunks:
            try:
                sent = self.socket.send(chunks[0], SEND_FLAGS)
            except BlockingIOError:
                break
            written += sent
            if sent < len(chunks[0]):
                chunks[0] = memoryview(chunks[0])[sent:]
                break
            chunks.popleft()
        return written

    def close(self) -> None:
        self.chunks.clear()
        self.socket.close()


class Inbox:
    """What one API server sends the engine process, read without ever blocking the engine loop: :meth:`read`
    takes what the pipe holds now and returns the messages it completes, whole; the part of one that has not all
    come yet waits here for the rest. A server stopped halfway through writing a large command (an add with a long
    prompt: megabytes), by a signal, a crash or a blocked thread, so holds back its own commands only (a blocking
    ``recv_bytes`` waited for the rest, and every server's streams with it). Messages are framed as
    ``Connection.send_bytes`` frames them."""

    def __init__(self, sock: socket.socket) -> None:
        self.socket = sock  # read with MSG_DONTWAIT, a flag of each read (the outbox writes through it the same way)
        self._allocate(INBOX_SIZE)
        self.start = 0  # where the first message not returned yet begins
        self.end = 0  # where the bytes read end

    def _allocate(self, size: int) -> None:
        self.buffer = bytearray(size)
        self.view = memoryview(self.buffer)

    @property
    def partial(self) -> bool:
        """Whether part of a message was read and the rest has not come yet."""
        return self.end > self.start

    def read(self) -> list[Any] | None:
        """The messages completed by what the pipe holds now (one read), unpickled; ``None`` when it holds nothing.
        Raises EOFError at the pipe's end (the server is gone, maybe halfway through a message), OSError when it
        fails."""
        try:
            received = self.socket.recv_into(self.view[self.end :], 0, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return None
        if not received:
            raise EOFError
        self.end += received
        messages = []
        view, start, end = self.view, self.start, self.end
        needed = 0  # the bytes of the message begun at start, header included, once its header came
        while end - start >= FRAME_LENGTH.size:
            (size,) = FRAME_LENGTH.unpack_from(view, start)
            header = FRAME_LENGTH.size
            if size == -1:
                if end - start < header + LONG_FRAME_LENGTH.size:
                    break
                (size,) = LONG_FRAME_LENGTH.unpack_from(view, start + header)
                header += LONG_FRAME_LENGTH.size
            if end - start < header + size:
                needed = header + size
                break
            messages.append(pickle.loads(view[start + header : start + header + size]))
            start += header + size
        if start == end:  # the usual case: whole messages only
            self.start = self.end = 0
            if len(self.buffer) > INBOX_SIZE:  # the room a large message took
                self._allocate(INBOX_SIZE)
        else:
            self._keep_partial(start, needed)
        return messages

    def _keep_partial(self, start: int, needed: int) -> None:
        """Keep the part of a message read (from ``start``), at the buffer's start, with room for the whole message
        (``needed`` bytes, when its header came)."""
        length = self.end - start
        if needed > len(self.buffer):
            rest = self.view[start : self.end]
            self._allocate(needed)
            self.view[:length] = rest
        elif start:
            self.buffer[:length] = self.buffer[start : self.end]
        self.start, self.end = 0, length


class ServerLinks:
    """The engine process's ends of the pipes of its API servers (one, or ``--api-servers`` of them): commands in
    from all of them, each event out to the server it concerns.

    The engine loop stays unaware of how many servers there are. A request's outputs go to the server that
    added it, and so does its :class:`Added` (answered once its grammar compiled, maybe while the loop runs another
    server's command); :class:`Aborted` to the server whose command the loop is running; the load both carry to
    the others as :class:`LoadChanged`; a step's stats to one server only (the first the :class:`Stepped` goes
    to), so that they are counted once; the load and step failures to all.

    Each server has its own flow control (this is the loop's :class:`OutputFlow`): a :class:`Stepped` goes to
    every server with fewer than :data:`MAX_UNHANDLED` unhandled (with the rows it added, maybe none) and
    carries the outputs of their requests only; a server's :class:`HandledCommand` frees its own window. A server
    that falls behind or stalls (a stopped process, a blocked event loop) so holds back its own requests'
    outputs, which the engine keeps collecting into one per request until it handles what it holds, and never
    those of the others. Nor does it fill its pipe: the load it is due while its window is full waits, as one
    :class:`LoadChanged`, for its next :class:`HandledCommand`. A server that stops (or whose pipe closes) is
    answered :class:`Stopped` and its requests are aborted; the loop stops once no server is left.

    No write waits for a server (:class:`Outbox`): what its pipe cannot take waits, and goes out as it reads. No
    read waits for one either (:class:`Inbox`): part of a command waits for the rest, and the loop goes on.
    A server that owes the engine something (a :class:`HandledCommand`, the reading of what waits for it, or the
    rest of a command it began) and makes no progress for ``stall_timeout`` seconds is taken for stalled: it is
    told why (as far as its pipe takes it), its requests are aborted, freeing their slots, its pipe is closed and
    ``on_stalled(index)`` runs (an engine process tells its supervisor, which kills that server:
    :mod:`rnnserve.server.api_servers`). An idle server owes nothing, and is not watched here (its supervisor
    watches its event loop).

    Each event is encoded before ``post`` returns (a :class:`Stepped` as an :class:`EncodedStep`, an error as one
    the server can unpickle): an event that cannot be encoded raises, so the loop stops and says so instead of
    leaving the servers waiting. A pipe that fails on write is a server gone."""

    def __init__(
        self,
        conns: list[Connection],
        stall_timeout: float | None = None,
        on_stalled: Callable[[int], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.conns = conns
        self.live: list[int] = list(range(len(conns)))
        self.owners: dict[str, int] = {}  # request id -> the server that added it
        self.encoder = OutputEncoder(self.owners)
        self.received: deque[tuple[int, Command]] = deque()  # the commands read, in order
        self.unhandled: dict[int, int] = dict.fromkeys(self.live, 0)  # per server still connected: Stepped unhandled
        self.load_owed: set[int] = set()  # servers whose LoadChanged waits for room in their window
        self.load: EngineLoad | None = None  # the latest the loop posted
        self.current: tuple[int, Command] | None = None  # the command the loop runs, and whose it is
        self.outboxes = {index: Outbox(conn) for index, conn in enumerate(conns)}
        self.inboxes = {index: Inbox(outbox.socket) for index, outbox in self.outboxes.items()}
        self.stall_timeout = stall_timeout
        self.on_stalled = on_stalled
        self.clock = clock
        self.silent_since: dict[int, float] = {}  # servers that owe something: since when they made no progress
        self.poller = select.poll()  # kept, not rebuilt per look as multiprocessing.connection.wait does (~7 us)
        self.watched: dict[int, int] = {}  # server -> the poll events watched on its pipe
        self.server_of_fd: dict[int, int] = {}
        for index, conn in enumerate(conns):
            self.server_of_fd[conn.fileno()] = index
            self._watch(index, select.POLLIN)

    def next_command(self, block: bool) -> Command | None:
        """The next command for the loop from any server (``None``: none queued and not ``block``)."""
        while True:
            if not self.received:
                if not self.live:
                    return StopCommand()
                for fd, events in self.poller.poll(self._poll_timeout(block)):
                    self._on_ready(self.server_of_fd[fd], events)
                self._detach_stalled()
                if not self.received and not block:
                    return None
                continue
            index, command = self.current = self.received.popleft()
            if index < 0:  # ours: a handled Stepped, or the aborts of a server gone
                return command
            if index not in self.live:  # sent before its server went (whose requests are aborted)
                continue
            if isinstance(command, StopCommand):
                self._send(index, Stopped(SHUTDOWN_MESSAGE))
                self._detach(index)
            else:
                if isinstance(command, AddCommand):
                    self.owners.update(dict.fromkeys(command.request_ids, index))
                return command

    def _poll_timeout(self, block: bool) -> int | None:
        """Milliseconds to wait for a pipe: none unless ``block``, and then until the next server may be stalled."""
        if not block:
            return 0
        if self.stall_timeout is None or not self.silent_since:
            return None
        wait = min(self.silent_since.values()) + self.stall_timeout - self.clock()
        return max(0, math.ceil(wait * 1000))

    def _on_ready(self, index: int, events: int) -> None:
        if events & select.POLLOUT:
            self._flush(index)
        if index in self.live:
            if events & ~select.POLLOUT:  # a command, or its end of file
                self._receive(index)
        elif events & (select.POLLHUP | select.POLLERR):  # a server that left, gone before it read its last bytes
            self._close(index)

    def _receive(self, index: int) -> bool:
        """Queue the commands of the messages that what server ``index``'s pipe holds now completes; whether it
        held anything. Part of a message is a debt: the server owes the rest."""
        inbox = self.inboxes[index]
        was_partial = inbox.partial
        try:
            messages = inbox.read()
        except (EOFError, OSError):  # the server is gone
            self._detach(index)
            return False
        if messages is None:
            return False
        for batch in messages:  # commands cross in lists (CommandSender)
            self.received.extend((index, command) for command in batch)
            if index in self.silent_since and any(type(command) is HandledCommand for command in batch):
                self.silent_since[index] = self.clock()  # progress, counted as it arrives (the loop may run it later)
        if was_partial or inbox.partial:
            if not self._owes(index):
                self.silent_since.pop(index, None)
            elif was_partial or index not in self.silent_since:  # more of a message begun (progress), or a new debt
                self.silent_since[index] = self.clock()
        return True

    def _owes(self, index: int) -> bool:
        """Whether live server ``index`` owes the engine something: the acknowledgement of a :class:`Stepped`, the
        reading of what waits for it, or the rest of a message it began."""
        return bool(self.unhandled[index]) or self.outboxes[index].pending or self.inboxes[index].partial

    def _send(self, index: int, message: object) -> None:
        outbox = self.outboxes.get(index)
        if outbox is None:  # closed
            return
        payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)  # raises for what cannot cross
        was_pending = outbox.pending
        try:
            outbox.put(payload)
        except OSError:  # the server is gone; its pipe's end of file detaches it
            outbox.chunks.clear()
            return
        if outbox.pending and not was_pending:
            self._watch(index, self.watched[index] | select.POLLOUT)
            if index in self.live and index not in self.silent_since:
                self.silent_since[index] = self.clock()

    def _flush(self, index: int) -> None:
        """Write what waits for server ``index`` as far as its pipe takes it."""
        outbox = self.outboxes[index]
        try:
            written = outbox.flush()
        except OSError:  # gone: a live server's end of file detaches it
            outbox.chunks.clear()
            written = 0
        if outbox.pending:
            if written and index in self.silent_since:
                self.silent_since[index] = self.clock()
        elif index in self.live:
            self._watch(index, select.POLLIN)
            if not self._owes(index):
                self.silent_since.pop(index, None)
            elif written:
                self.silent_since[index] = self.clock()
        else:  # a server that left has its last bytes
            self._watch(index, 0)

    def _watch(self, index: int, events: int) -> None:
        """Poll server ``index``'s pipe for ``events`` (0: not at all)."""
        fd = self.conns[index].fileno()
        if not events:
            if self.watched.pop(index, None) is not None:
                self.poller.unregister(fd)
        elif index in self.watched:
            self.poller.modify(fd, events)
            self.watched[index] = events
        else:
            self.poller.register(fd, events)
            self.watched[index] = events

    def _detach(self, index: int) -> None:
        """Server ``index`` is gone: abort its requests and stop waiting for it (what is still on its way to it,
        such as the :class:`Stopped` that answers its stop, goes on as it reads)."""
        if index not in self.live:
            return
        self.live.remove(index)
        del self.unhandled[index]
        self.load_owed.discard(index)
        self.silent_since.pop(index, None)
        self.inboxes.pop(index, None)  # what it began to send, never to be whole
        self._watch(index, select.POLLOUT if self.outboxes[index].pending else 0)
        orphans = [request_id for request_id, owner in self.owners.items() if owner == index]
        if orphans:
            self.received.append((-1, AbortCommand(orphans)))

    def _detach_stalled(self) -> None:
        """Detach the servers that owe something and made no progress for ``stall_timeout`` seconds; each is
        first read from and written to once more (a step longer than that kept the loop from looking)."""
        if self.stall_timeout is None or not self.silent_since:
            return
        now = self.clock()
        for index, since in list(self.silent_since.items()):
            if now - since < self.stall_timeout or index not in self.live:
                continue
            self._flush(index)
            while index in self.live and self._receive(index):
                pass
            since = self.silent_since.get(index, now)
            if index in self.live and now - since >= self.stall_timeout:
                self._detach_stalled_server(index, now - since)

    def _detach_stalled_server(self, index: int, seconds: float) -> None:
        requests = sum(1 for owner in self.owners.values() if owner == index)
        if self.inboxes[index].partial:
            silence = f"sent none of the rest of a command it began for {seconds:.1f} s"
        else:
            silence = f"took none of its outputs for {seconds:.1f} s"
        logger.error(
            "API server %d %s (--api-server-stall-timeout %g): detached as stalled, its %d requests aborted",
            index, silence, self.stall_timeout, requests,
        )  # fmt: skip
        why = f"the engine detached this API server: it {silence} (stalled)"
        self._send(index, Stopped(why))  # as far as its pipe takes it now
        self._detach(index)
        self._close(index)
        if self.on_stalled is not None:
            self.on_stalled(index)

    def _close(self, index: int) -> None:
        """Close the engine's end of server ``index``'s pipe, dropping what it did not read."""
        self._watch(index, 0)
        outbox = self.outboxes.pop(index, None)
        if outbox is not None:
            outbox.close()
        self.conns[index].close()

    def flush_all(self, timeout: float) -> None:
        """Once the loop ended: wait (at most ``timeout`` seconds) for the servers that left to read their last
        bytes (each its :class:`Stopped`)."""
        deadline = self.clock() + timeout
        while self.watched and (remaining := deadline - self.clock()) > 0:
            for fd, events in self.poller.poll(math.ceil(remaining * 1000)):
                self._on_ready(self.server_of_fd[fd], events)

    def has_room(self) -> bool:
        return any(count < MAX_UNHANDLED for count in self.unhandled.values())

    def wanted(self) -> Callable[[SequenceGroup], bool] | None:
        behind = {index for index, count in self.unhandled.items() if count >= MAX_UNHANDLED}
        if not behind:
            return None
        owners = self.owners  # a request without one: its server is gone, and its output goes nowhere
        return lambda group: owners.get(group.request_id) not in behind

    def handled(self, command: HandledCommand) -> None:
        """The server whose command the loop runs handled a :class:`Stepped`; the load it is due follows."""
        assert self.current is not None and self.current[1] is command
        index = self.current[0]
        self.unhandled[index] -= 1
        if not self._owes(index):
            self.silent_since.pop(index, None)
        if index in self.load_owed:
            self.load_owed.discard(index)
            self._send(index, LoadChanged(self.load))  # type: ignore[arg-type]  # owed: a load was posted

    def post(self, event: Event) -> None:
        if isinstance(event, Added | Aborted | Stepped | LoadChanged):
            self.load = event.load
        if isinstance(event, Stepped):  # its outputs are rows already (run_engine_process)
            self._post_step(event)
            return
        if isinstance(event, StepFailed | Stopped):
            for index in list(self.live):
                self._send(index, event)
            return
        if isinstance(event, LoadChanged):  # grammars queued to compile: every server's gauges count them
            for index in self.live:
                self._send_load(index, event)
            return
        if isinstance(event, Added):  # to the server that added them: the loop may be running another's command
            index = self.owners.get(event.request_ids[0], -1)  # (an add whose grammar compiled meanwhile)
            if event.error is not None:
                for request_id in event.request_ids:
                    self.owners.pop(request_id, None)
                event = dataclasses.replace(event, error=portable_error(event.error))
        else:
            index = self.current[0] if self.current is not None else -1
            finished = [out.request_id for out in event.finals]
            self.encoder.forget(finished)
            for request_id in finished:
                self.owners.pop(request_id, None)
        if index in self.live:
            self._send(index, event)
        for other in self.live:  # without it, a server kept the load of its last step: a cancelled stream on
            if other != index:  # another server left it showing a running request on an idle engine
                self._send_load(other, LoadChanged(event.load))

    def _send_load(self, index: int, event: LoadChanged) -> None:
        """Send server ``index`` the load, or owe it until it handles a :class:`Stepped` when its window is full or
        its pipe backed up: one per add would fill the pipe of a server that stalls."""
        if self.unhandled[index] < MAX_UNHANDLED and not self.outboxes[index].pending:
            self._send(index, event)
        else:
            self.load_owed.add(index)

    def _post_step(self, event: Stepped) -> None:
        rows: dict[int, list[OutputRow]] = {index: [] for index in self.live}
        owners = self.owners
        for row in event.outputs:  # full rows (the compact outputs come in columns): a request's last routes last
            owner = owners.pop(row[0], None) if row[3] else owners.get(row[0])
            if owner in rows:
                rows[owner].append(row)  # type: ignore[index]
        deltas = event.deltas or {}  # a server that is gone has its column dropped
        # The servers with room; with outputs beyond it only after a failed step (the loop then posts everything),
        # when the stats, if no server has room, go to the first.
        receivers = [index for index in self.live
                     if self.unhandled[index] < MAX_UNHANDLED or rows[index] or index in deltas]  # fmt: skip
        for position, index in enumerate(receivers or self.live[:1]):
            self.unhandled[index] += 1
            if index not in self.silent_since:
                self.silent_since[index] = self.clock()
            steps = event.steps if position == 0 else []
            self._send(index, EncodedStep(rows[index], steps, event.load, deltas.get(index, [])))


class CommandSender:
    """The server process's end of the command pipe: :meth:`send` queues a command and returns at once; a thread
    of its own pickles and writes what queued up as one message (a list). The event loop so never waits for
    a pipe write (a few hundred microseconds of wall time each on a busy host), and a burst of arrivals costs
    one write and one wake-up of the engine process, not one per request. Ends after sending a
    :class:`StopCommand`, or once the pipe is closed (the engine process is gone)."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="rnnserve-engine-commands", daemon=True)

    def send(self, command: Command) -> None:
        self.commands.put(command)

    def _run(self) -> None:
        while True:
            batch = [self.commands.get()]
            while not self.commands.empty():
                batch.append(self.commands.get())
            try:
                send_message(self.conn, batch)
            except OSError:
                return
            if any(isinstance(command, StopCommand) for command in batch):
                return


def send_message(conn: Connection, message: object) -> None:
    """Pickle ``message`` whole (tensors by value, never through shared memory) and send it."""
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def receive_message(conn: Connection) -> Any:
    return pickle.loads(conn.recv_bytes())


@contextmanager
def sigint_ignored() -> Iterator[None]:
    """Ignore SIGINT meanwhile (from the main thread; elsewhere a no-op): processes started now inherit that
    through exec, so a Ctrl-C, which reaches the whole process group, leaves them alone while they start up;
    their parent stops them instead."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def run_engine_process(
    conns: list[Connection],
    config: EngineConfig,
    factory: EngineFactory,
    log_level: int,
    limits: LoopLimits,
    stalls: Connection | None = None,
) -> None:
    """The engine process's main: build the engine, report its :class:`EngineInfo` (or :class:`LoadFailed`) to
    each server, then run the engine loop on the commands that arrive (:class:`ServerLinks`), until every server
    has stopped or gone; then the process ends at once (:func:`exit_process`). The index of each server detached
    as stalled is sent on ``stalls``, when given."""
    # Ctrl-C, or a SIGTERM to the whole group (systemd's KillMode=control-group), reaches this process too: the
    # servers drain, and this process ends when they have stopped (a SIGTERM failed every in-flight request at once)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s [engine]: %(message)s")
    try:
        engine = factory(config)
    except Exception as err:  # noqa: BLE001 - reported to the servers, which raise it
        for conn in conns:
            send_message(conn, LoadFailed(portable_error(err)))
        return
    info = EngineInfo.of(engine)
    for conn in conns:
        send_message(conn, info)
    freeze_startup_heap()
    retain_freed_memory()

    def report_stall(index: int) -> None:
        if stalls is not None:
            try:
                send_message(stalls, index)
            except OSError:  # the supervisor is gone
                pass

    links = ServerLinks(conns, limits.stall_timeout, report_stall)
    EngineCore(engine, links.next_command, links.post, links.encoder.row, links, limits.max_compiling,
               links.encoder).run()  # fmt: skip
    links.flush_all(STOPPED_DELIVERY_SECONDS)
    exit_process(0)  # a server (or the supervisor) waits for this process's end to end its own


class EngineProcess:
    """The engine in a process of its own (spawned, so it may use CUDA), built by ``factory(config)``, with one
    pipe per API server (``connections``) and the loop's ``limits``. With ``report_stalls``, :attr:`stalls` is a
    pipe on which the engine sends the index of each server it detached as stalled. Construction blocks until the
    engine is loaded and raises what loading raised (e.g. ``ModelLoadError``)."""

    def __init__(
        self,
        config: EngineConfig,
        factory: EngineFactory | None = None,
        log_level: int = logging.INFO,
        num_servers: int = 1,
        limits: LoopLimits | None = None,
        report_stalls: bool = False,
    ) -> None:
        context = multiprocessing.get_context("spawn")
        pipes = [context.Pipe() for _ in range(num_servers)]
        self.connections = [server_end for server_end, _ in pipes]
        self.stalls: Connection | None = None
        stalls_end: Connection | None = None
        if report_stalls:
            self.stalls, stalls_end = context.Pipe(duplex=False)
        self.process = context.Process(
            target=run_engine_process,
            args=([engine_end for _, engine_end in pipes], config, factory or LLMEngine.from_config, log_level,
                  limits or LoopLimits(), stalls_end),  # fmt: skip
            name="rnnserve-engine",
            daemon=True,
        )
        with sigint_ignored():
            self.process.start()
        for _, engine_end in pipes:
            engine_end.close()
        if stalls_end is not None:
            stalls_end.close()
        try:
            answers = [receive_message(conn) for conn in self.connections]
        except EOFError as err:  # a load failure, told in one line as any other (it was a raw traceback)
            self.process.join()
            code = self.process.exitcode
            raise ModelLoadError(f"the engine process exited while loading (exit code {code})") from err
        if isinstance(answers[0], LoadFailed):
            self.process.join()
            raise answers[0].error
        self.info: EngineInfo = answers[0]

    def close_links(self, timeout: float = 30.0) -> None:
        """End the engine before any server took its link: closed, the links tell it to stop."""
        for conn in self.connections:
            conn.close()
        self.join(timeout)

    def join(self, timeout: float) -> None:
        """Wait for the process to end (once its servers stopped), bounded; killed after that."""
        self.process.join(timeout)
        if self.process.is_alive():
            logger.warning("the engine process did not stop within %.0f s; killing it", timeout)
            self.process.kill()
            self.process.join()


class ProcessDriver:
    """A server's link to the engine in its own process: ``conn`` (one of :attr:`EngineProcess.connections`),
    ``info`` what the engine reported, ``process`` the engine process when this server owns it (stopping the
    driver then waits for it)."""

    engine = None  # the live engine is in the other process

    def __init__(self, conn: Connection, info: EngineInfo, process: EngineProcess | None = None) -> None:
        self._conn = conn
        self.info = info
        self._process = process
        self._sender = CommandSender(conn)
        self._sender.thread.start()
        self._reader: threading.Thread | None = None
        self._stopped = False
        self.decoder = OutputDecoder()

    @classmethod
    def spawn(
        cls,
        config: EngineConfig,
        factory: EngineFactory | None = None,
        log_level: int = logging.INFO,
        limits: LoopLimits | None = None,
    ) -> ProcessDriver:
        """A driver owning a new engine process that serves it alone."""
        process = EngineProcess(config, factory, log_level, limits=limits)
        return cls(process.connections[0], process.info, process)

    @property
    def pid(self) -> int | None:
        return self._process.process.pid if self._process is not None else None

    @property
    def running(self) -> bool:
        return self._reader is not None and self._reader.is_alive() and not self._stopped

    def start(self, loop: asyncio.AbstractEventLoop, handle: EventHandler) -> None:
        post = post_to(loop, acknowledging(handle, self.send))
        self._reader = threading.Thread(target=self._read, args=(post,), name="rnnserve-engine-events", daemon=True)
        self._reader.start()

    def _read(self, post: EventHandler) -> None:
        """Forward the engine's events to the event loop (outputs decoded here, off the loop) until it stops."""
        while True:
            try:
                event = receive_message(self._conn)
            except (EOFError, OSError):
                event = Stopped(self._exit_message())
            if isinstance(event, EncodedStep):
                post(Stepped(self.decoder.decode_step(event), event.steps, event.load))
                continue
            if isinstance(event, Aborted):
                self.decoder.forget([out.request_id for out in event.finals])
            elif isinstance(event, Stopped):
                self._stopped = True
            post(event)
            if self._stopped:
                return

    def _exit_message(self) -> str:
        if self._process is None:
            return "the engine process exited"
        self._process.process.join(5)
        return f"the engine process exited (exit code {self._process.process.exitcode})"

    def send(self, command: Command) -> None:
        """Queue a command for the engine process; a dead one is not an error here (its :class:`Stopped` fails
        the rest)."""
        self._sender.send(command)

    def stop(self, timeout: float) -> None:
        """Stop this server's link (the engine loop stops once all its servers did) and wait for it, and for the
        engine process when this driver owns it (bounded; killed after that)."""
        self.send(StopCommand())
        if self._process is not None:
            self._process.join(timeout)
        if self._reader is not None:
            self._reader.join(timeout)
        self._sender.thread.join(timeout)
        self._conn.close()


EngineDriver = ThreadDriver | ProcessDriver
