"""The engine's side of the server: the loop that drives an :class:`LLMEngine` (:class:`EngineCore`) and the
two places it can run.

* :class:`ThreadDriver`: a thread of the server's process (:class:`EngineThread`). Simple, and right on a CPU,
  where the model step is the host's own work.
* :class:`ProcessDriver`: a process of its own, as vLLM's engine core. On a GPU the engine's host work
  (scheduling, sampling bookkeeping, detokenizing) and the HTTP event loop (routing outputs, one SSE write per
  stream) both need a Python interpreter; in one process they take turns on its lock, and at a few hundred
  streams neither keeps up with the device. The server process then only serves HTTP; the engine process only
  steps the engine.

The loop and the server speak in messages (commands in, events out), the same ones in both places; across
processes they are pickled through a pipe, the server's commands written by a thread of their own
(:class:`CommandSender`). A step's outputs cross as rows of plain data, which the engine process builds straight
from its requests (:class:`OutputEncoder` / :class:`OutputDecoder`: no output objects on the engine's side, and
several times cheaper to pickle than dataclasses, which matters at a few hundred outputs per step), each
carrying its request's prompt (ids, text, prompt logprobs) only the first time, so a long prompt is not pickled
once per generated token. The loop posts a step's outputs only while the server has handled all but one of those
it posted before (:class:`EngineCore`), so a busy server gets fewer, larger messages.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import multiprocessing
import operator
import pickle
import queue
import signal
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, wait
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, TypeVar

import torch

from rnnserve.engine.config import EngineConfig
from rnnserve.engine.llm_engine import EngineLoad, LLMEngine, StepStats, freeze_startup_heap
from rnnserve.engine.models.base import StateSpec
from rnnserve.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from rnnserve.engine.sampling_params import SamplingParams
from rnnserve.engine.sequence import SequenceGroup
from rnnserve.engine.state_snapshot import StateSnapshot
from rnnserve.engine.tokenizer import Tokenizer

logger = logging.getLogger("rnnserve.engine")

Prompt = str | list[int]
OutputRow = tuple  # one RequestOutput as plain data (see OutputEncoder)
T = TypeVar("T")
EngineFactory = Callable[[EngineConfig], LLMEngine]
SHUTDOWN_MESSAGE = "the server is shutting down"
# Stepped events the server may hold unhandled: one it handles and the next, ready when it is done (one alone
# would make it wait for the end of the engine's step after each).
MAX_UNHANDLED = 2


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
    request_ids: list[str]


@dataclass
class HandledCommand:
    """The server handled a :class:`Stepped`: the engine loop may post another."""


@dataclass
class StopCommand:
    pass


Command = AddCommand | AbortCommand | HandledCommand | StopCommand


# --- events (engine -> server) ---------------------------------------------------------------------------


@dataclass
class Added:
    """The outcome of an :class:`AddCommand`: ``error`` is what ``add_request`` raised (nothing was added)."""

    add_id: int
    error: Exception | None
    load: EngineLoad


@dataclass
class Aborted:
    """Requests aborted on the server's command, with their final outputs (for metrics)."""

    finals: list[RequestOutput]
    load: EngineLoad


@dataclass
class Stepped:
    """Engine steps and their outputs: one step, or the steps run while the server handled the previous
    :class:`Stepped` (each request's output then covers them all); ``steps`` has each step's stats. In the
    engine process the outputs are already the rows they cross as (:meth:`OutputEncoder.row`)."""

    outputs: list[RequestOutput] | list[OutputRow]
    steps: list[StepStats]
    load: EngineLoad


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


Event = Added | Aborted | Stepped | StepFailed | Stopped


def portable_error(error: Exception) -> Exception:
    """``error`` if it survives pickling, else a RuntimeError with its type and message."""
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:  # noqa: BLE001 - any failure means it cannot cross
        return RuntimeError(f"{type(error).__name__}: {error}")
    return error


class EngineCore:
    """Drives an :class:`LLMEngine`: runs the commands ``next_command(block)`` returns (``None``: none
    queued), steps while requests are unfinished, blocks for a command when idle, and reports each outcome
    through ``post``. One instance per engine; :meth:`run` ends with a :class:`Stopped` event.

    Outputs flow with at most :data:`MAX_UNHANDLED` messages in flight: once that many :class:`Stepped` are
    posted, the loop builds the next one only after the server says (:class:`HandledCommand`) that it handled
    one. Steps run meanwhile collect nothing; the next collection builds each request's output once for all of
    them (``LLMEngine.step``). So a server that falls behind the device costs the engine one output per request
    per message, not per step, and its streams send several tokens a chunk, instead of the engine slowing down
    to build and send outputs that queue up."""

    def __init__(
        self,
        engine: LLMEngine,
        next_command: Callable[[bool], Command | None],
        post: Callable[[Event], None],
        collect: Callable[[], list[RequestOutput]] | Callable[[], list[OutputRow]] | None = None,
    ) -> None:
        self.engine = engine
        self.next_command = next_command
        self.post = post
        self.collect = collect or engine.collect_outputs  # what a Stepped carries
        self.unhandled = 0  # Stepped events posted and not handled by the server yet
        self.steps: list[StepStats] = []  # the stats of the steps not posted yet

    def run(self) -> None:
        message = SHUTDOWN_MESSAGE
        try:
            wait_for_command = True
            while self._run_commands(wait_for_command):
                # Wait for the next command when idle, after a failed step (the server answers with aborts), and
                # while the last steps' outputs wait for the server to handle the previous ones.
                if self.engine.has_unfinished_requests():
                    wait_for_command = not self._step()
                else:
                    self._post_outputs_if_room()
                    wait_for_command = True
        except Exception:
            logger.exception("engine loop crashed")
            message = "the engine stopped after an internal error"
        finally:
            self.post(Stopped(message))

    def _run_commands(self, block: bool) -> bool:
        """Execute the queued commands, first waiting for one if ``block``; False once told to stop."""
        while (command := self.next_command(block)) is not None:
            block = False
            if isinstance(command, StopCommand):
                return False
            if isinstance(command, HandledCommand):
                self.unhandled -= 1
            elif isinstance(command, AddCommand):
                self._add(command)
            else:
                finals = [out for i in command.request_ids if (out := self.engine.abort_request(i)) is not None]
                self.post(Aborted(finals, self.engine.load()))
        return True

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
        self.post(Added(command.add_id, error, self.engine.load()))

    def _step(self) -> bool:
        """One engine step, its outputs posted now or (while the server holds :data:`MAX_UNHANDLED` unhandled)
        with a later step's; False if the step itself raised. With async scheduling (a GPU) the step returns once the
        next one is queued on the device, so its outputs are built and sent meanwhile."""
        try:
            self.engine.step(collect=False)
        except Exception as err:
            logger.exception("engine step failed; failing every in-flight request")
            if self._has_unposted():  # what earlier steps finished still reaches its clients
                self._post_outputs()
            self.post(StepFailed(f"{type(err).__name__}: {err}"))
            return False
        self.steps.append(self.engine.last_step)
        self._post_outputs_if_room()
        return True

    def _has_unposted(self) -> bool:
        return bool(self.steps) or self.engine.has_uncollected_outputs

    def _post_outputs_if_room(self) -> None:
        if self.unhandled < MAX_UNHANDLED and self._has_unposted():
            self._post_outputs()

    def _post_outputs(self) -> None:
        steps, self.steps = self.steps, []
        self.unhandled += 1
        self.post(Stepped(self.collect(), steps, self.engine.load()))


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
    """Runs the engine loop on an :class:`EngineThread` of this process; ``engine`` is the live engine."""

    def __init__(self, engine: LLMEngine, thread: EngineThread | None = None) -> None:
        self.engine = engine
        self.info = EngineInfo.of(engine)
        self.thread = thread or EngineThread()
        self.commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._done: Future[None] | None = None

    @property
    def running(self) -> bool:
        return self._done is not None and not self._done.done()

    def start(self, loop: asyncio.AbstractEventLoop, handle: EventHandler) -> None:
        core = EngineCore(self.engine, self._next_command, post_to(loop, acknowledging(handle, self.send)))
        self._done = self.thread.submit(core.run)

    def _next_command(self, block: bool) -> Command | None:
        try:
            return self.commands.get(block=block)
        except queue.Empty:
            return None

    def send(self, command: Command) -> None:
        self.commands.put(command)

    def stop(self, timeout: float) -> None:
        """Stop the loop and wait for it (bounded), then end the thread."""
        self.send(StopCommand())
        if self._done is not None:
            wait([self._done], timeout)
        self.thread.close()


metrics_fields = operator.attrgetter(*(f.name for f in dataclasses.fields(RequestMetrics)))


class OutputEncoder:
    """Engine side: each request's output as a row of plain data, built straight from the request (no output
    objects in between: at a few hundred streams that halves the engine's cost of an output), which pickles
    several times faster than dataclass instances, and without the prompt (text, ids, logprobs) after a
    request's first output."""

    def __init__(self) -> None:
        self.sent: set[str] = set()

    def row(self, group: SequenceGroup) -> OutputRow:
        """``group.output()`` as a row (:class:`OutputDecoder` turns it back into that output)."""
        request_id, finished = group.request_id, group.finished
        if request_id in self.sent:
            prompt = None
        else:
            prompt = (group.prompt, group.prompt_token_ids, group.prompt_logprobs)
        if finished:
            self.sent.discard(request_id)
        else:
            self.sent.add(request_id)
        kind = group.params.output_kind
        samples = [seq.take_output_fields(kind) for seq in group.seqs]
        return (request_id, prompt, samples, finished, metrics_fields(group.metrics), group.error,
                group.num_cached_tokens, group.final_state)  # fmt: skip

    def forget(self, request_ids: list[str]) -> None:
        self.sent.difference_update(request_ids)


class OutputDecoder:
    """Server side: rows back into :class:`RequestOutput` objects, each with its request's prompt (kept from
    the request's first output until it finishes)."""

    def __init__(self) -> None:
        self.prompts: dict[str, tuple[str | None, list[int], Any]] = {}

    def decode(self, rows: list[OutputRow]) -> list[RequestOutput]:
        outputs = []
        for request_id, prompt, samples, finished, times, error, num_cached, final_state in rows:
            if prompt is None:
                prompt = self.prompts[request_id]
            if finished:
                self.prompts.pop(request_id, None)
            else:
                self.prompts[request_id] = prompt
            completions = [CompletionOutput(*fields) for fields in samples]
            text, token_ids, logprobs = prompt
            outputs.append(RequestOutput(request_id, text, token_ids, completions, finished, RequestMetrics(*times),
                                         error, logprobs, num_cached, final_state))  # fmt: skip
        return outputs

    def forget(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.prompts.pop(request_id, None)


@dataclass
class EncodedStep:
    """:class:`Stepped` as it crosses between processes."""

    rows: list[OutputRow]
    steps: list[StepStats]
    load: EngineLoad


class EventSender:
    """The engine process's end of the pipe: each event the engine loop posts crosses as one message, sent
    before ``post`` returns (a :class:`Stepped` as an :class:`EncodedStep`, an error as one the server can
    unpickle). A closed pipe is ignored (the server is gone: the loop's next command read ends it); an event
    that cannot be encoded raises, so the loop stops and says so instead of leaving the server waiting."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.encoder = OutputEncoder()

    def post(self, event: Event) -> None:
        message = self.message(event)
        try:
            send_message(self.conn, message)
        except OSError:
            pass

    def message(self, event: Event) -> object:
        """What ``event`` crosses as."""
        if isinstance(event, Stepped):  # its outputs are rows already (run_engine_process)
            return EncodedStep(event.outputs, event.steps, event.load)
        if isinstance(event, Added) and event.error is not None:
            return Added(event.add_id, portable_error(event.error), event.load)
        if isinstance(event, Aborted):
            self.encoder.forget([out.request_id for out in event.finals])
        return event


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


def run_engine_process(conn: Connection, config: EngineConfig, factory: EngineFactory, log_level: int) -> None:
    """The engine process's main: build the engine, report its :class:`EngineInfo` (or :class:`LoadFailed`),
    then run the engine loop on the commands that arrive, until told to stop or the server's end closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the server stops us itself
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s [engine]: %(message)s")
    try:
        engine = factory(config)
    except Exception as err:  # noqa: BLE001 - reported to the server, which raises it
        send_message(conn, LoadFailed(portable_error(err)))
        return
    send_message(conn, EngineInfo.of(engine))
    freeze_startup_heap()

    received: deque[Command] = deque()  # commands cross in lists (CommandSender)

    def next_command(block: bool) -> Command | None:
        if not received:
            try:
                if not block and not conn.poll():
                    return None
                received.extend(receive_message(conn))
            except (EOFError, OSError):  # the server is gone
                return StopCommand()
        return received.popleft()

    sender = EventSender(conn)
    EngineCore(engine, next_command, sender.post, collect=lambda: engine.collect(sender.encoder.row)).run()


class ProcessDriver:
    """Runs the engine in a process of its own (spawned, so it may use CUDA), built by ``factory(config)``.
    Construction blocks until the engine is loaded and raises what loading raised (e.g. ``ModelLoadError``)."""

    engine = None  # the live engine is in the other process

    def __init__(
        self, config: EngineConfig, factory: EngineFactory | None = None, log_level: int = logging.INFO
    ) -> None:
        factory = factory or LLMEngine.from_config
        context = multiprocessing.get_context("spawn")
        self._conn, child_conn = context.Pipe()
        self._process = context.Process(
            target=run_engine_process,
            args=(child_conn, config, factory, log_level),
            name="rnnserve-engine",
            daemon=True,
        )
        self._process.start()
        child_conn.close()
        self._sender = CommandSender(self._conn)
        self._reader: threading.Thread | None = None
        self._stopped = False
        self.decoder = OutputDecoder()
        try:
            first = receive_message(self._conn)
        except EOFError as err:
            self._process.join()
            code = self._process.exitcode
            raise RuntimeError(f"the engine process exited while loading (exit code {code})") from err
        if isinstance(first, LoadFailed):
            self._process.join()
            raise first.error
        self.info: EngineInfo = first
        self._sender.thread.start()

    @property
    def pid(self) -> int | None:
        return self._process.pid

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
                self._process.join(5)
                event = Stopped(f"the engine process exited (exit code {self._process.exitcode})")
            if isinstance(event, EncodedStep):
                post(Stepped(self.decoder.decode(event.rows), event.steps, event.load))
                continue
            if isinstance(event, Aborted):
                self.decoder.forget([out.request_id for out in event.finals])
            elif isinstance(event, Stopped):
                self._stopped = True
            post(event)
            if self._stopped:
                return

    def send(self, command: Command) -> None:
        """Queue a command for the engine process; a dead one is not an error here (its :class:`Stopped` fails
        the rest)."""
        self._sender.send(command)

    def stop(self, timeout: float) -> None:
        """Stop the loop and wait for the process (bounded; killed after that)."""
        self.send(StopCommand())
        self._process.join(timeout)
        if self._process.is_alive():
            logger.warning("the engine process did not stop within %.0f s; killing it", timeout)
            self._process.kill()
            self._process.join()
        if self._reader is not None:
            self._reader.join(timeout)
        self._sender.thread.join(timeout)
        self._conn.close()


EngineDriver = ThreadDriver | ProcessDriver
