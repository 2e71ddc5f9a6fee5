"""The engine loop's flow of outputs: at most two :class:`Stepped` in flight, the steps run meanwhile collected
into the next one, nothing lost or repeated, whatever pace the server keeps; grammars compiled off the loop."""

from __future__ import annotations

import gc
import queue
import threading
import time
import weakref
from collections.abc import Callable

import pytest

from rnnserve.engine.llm_engine import LLMEngine
from rnnserve.engine.sampling_params import InvalidParameterError, OutputKind, SamplingParams, StructuredOutputParams
from rnnserve.engine.scheduler import QueueFullError
from rnnserve.server.engine_core import (
    DEFAULT_MAX_COMPILING,
    MAX_UNHANDLED,
    AbortCommand,
    AddCommand,
    Added,
    Command,
    EngineCore,
    Event,
    HandledCommand,
    LoadChanged,
    StepFailed,
    Stepped,
    StopCommand,
    Stopped,
)
from tests.engine.conftest import make_engine
from tests.server.conftest import hold_grammar_compiles

PARAMS = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, output_kind=OutputKind.DELTA)


def scripted(blocking: list[Command], polled: Callable[[int], list[Command]]) -> Callable[[bool], Command | None]:
    """``next_command``: a blocking read takes the next of ``blocking`` (then stops the loop); the ``k``-th
    non-blocking poll (one per step) returns the commands ``polled(k)`` lists, one by one."""
    polls = 0
    pending: list[Command] = []

    def next_command(block: bool) -> Command | None:
        nonlocal polls
        if block:
            return blocking.pop(0) if blocking else StopCommand()
        if not pending:
            polls += 1
            pending.extend(polled(polls))
            pending.append(None)  # type: ignore[arg-type]  # the end of this poll's commands
        return pending.pop(0)

    return next_command


def run_core(polled: Callable[[int], list[Command]]) -> list[Event]:
    """The events of a loop that serves two requests; the server handles the last outputs when the loop is
    idle, then stops it."""
    engine = make_engine()
    add = AddCommand(0, ["a", "b"], ["Once upon", "The cat"], PARAMS, 0.0)
    events: list[Event] = []
    EngineCore(engine, scripted([add, HandledCommand()], polled), events.append).run()
    assert engine.pool.num_used == 0
    return events


def tokens_of(events: list[Event]) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {"a": [], "b": []}
    for event in events:
        if isinstance(event, Stepped):
            for out in event.outputs:
                tokens[out.request_id] += out.outputs[0].new_token_ids
    return tokens


def test_a_server_that_keeps_up_gets_every_step_and_one_that_does_not_gets_them_collected() -> None:
    keeps_up = run_core(lambda poll: [HandledCommand()])  # each step's outputs handled before the next step
    stepped = [e for e in keeps_up if isinstance(e, Stepped)]
    assert len(stepped) == PARAMS.max_tokens and all(len(e.steps) == 1 for e in stepped)

    # Handled before every third step: two messages in flight, then the steps in between post nothing and the
    # next message carries them all.
    slow = run_core(lambda poll: [HandledCommand()] if poll % 3 == 0 else [])
    stepped = [e for e in slow if isinstance(e, Stepped)]
    assert [len(e.steps) for e in stepped] == [1, 1, 1, 3, 3, 1]
    assert [len(e.outputs[0].outputs[0].new_token_ids) for e in stepped] == [1, 1, 1, 3, 3, 1]
    assert tokens_of(slow) == tokens_of(keeps_up) and all(len(t) == 10 for t in tokens_of(slow).values())
    assert sum(e.outputs[0].finished for e in stepped) == 1 and isinstance(slow[-1], Stopped)

    # Never handled while running: the first two steps' outputs, then the rest once the loop is idle and told so.
    late = run_core(lambda poll: [])
    stepped = [e for e in late if isinstance(e, Stepped)]
    assert [len(e.steps) for e in stepped] == [1, 1, 8]
    assert tokens_of(late) == tokens_of(keeps_up)


def test_an_abort_takes_the_uncollected_progress_of_its_request() -> None:
    """``b`` is aborted while its last step waits for the server: it ends in the abort's final output."""
    events = run_core(lambda poll: [AbortCommand(["b"])] if poll == 4 else [])
    [aborted] = [e for e in events if not isinstance(e, Stepped | Added | Stopped)]
    streamed = tokens_of(events)["b"]
    (final,) = aborted.finals  # type: ignore[union-attr]
    assert final.outputs[0].finish_reason == "abort"
    assert len(streamed) == 2 and len(final.outputs[0].new_token_ids) == 1  # step 3, never posted
    assert len(tokens_of(events)["a"]) == 10


def test_a_failed_step_first_posts_what_earlier_steps_left() -> None:
    engine = make_engine()
    engine.add_request("Once upon", PARAMS, "a")
    events: list[Event] = []
    core = EngineCore(engine, lambda block: StopCommand() if block else None, events.append)
    core.flow.unhandled = MAX_UNHANDLED  # type: ignore[attr-defined]  # the server holds as many as it may
    assert core._step() and core._step() and events == []
    engine.scheduler.schedule = None  # type: ignore[assignment, method-assign]  # the next step raises
    assert not core._step()
    assert [type(e) for e in events] == [Stepped, StepFailed]
    assert len(events[0].steps) == 2 and len(events[0].outputs[0].outputs[0].new_token_ids) == 2  # type: ignore[union-attr]


def test_the_num_tokens_index_follows_completion_output() -> None:
    from rnnserve.engine.outputs import CompletionOutput
    from rnnserve.server.engine_core import NUM_TOKENS_FIELD

    assert list(CompletionOutput.__dataclass_fields__)[NUM_TOKENS_FIELD] == "num_tokens"


class CoreThread:
    """An engine loop on a thread of its own, fed through a queue as the server feeds it; it records its events
    and acknowledges each :class:`Stepped` at once (a server that keeps up)."""

    def __init__(self, engine: LLMEngine, max_compiling: int = DEFAULT_MAX_COMPILING) -> None:
        self.commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self.events: list[Event] = []
        self.core = EngineCore(engine, self.next_command, self.post, max_compiling=max_compiling)
        self.thread = threading.Thread(target=self.core.run, daemon=True)
        self.thread.start()

    def next_command(self, block: bool) -> Command | None:
        try:
            return self.commands.get(block=block)
        except queue.Empty:
            return None

    def post(self, event: Event) -> None:
        self.events.append(event)
        if isinstance(event, Stepped):
            self.commands.put(HandledCommand())

    def tokens(self, request_id: str) -> int:
        return sum(len(out.outputs[0].new_token_ids) for e in list(self.events) if isinstance(e, Stepped)
                   for out in e.outputs if out.request_id == request_id)  # fmt: skip

    def added(self, add_id: int) -> Added | None:
        return next((e for e in list(self.events) if isinstance(e, Added) and e.add_id == add_id), None)

    def wait_for(self, condition: Callable[[], object], timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            assert time.monotonic() < deadline, "timed out"
            time.sleep(0.005)

    def stop(self) -> None:
        self.commands.put(StopCommand())
        self.thread.join(30)
        assert isinstance(self.events[-1], Stopped)


def test_grammars_compile_off_the_engine_loop_while_other_requests_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """A schema of 8000 objects compiled on the loop for 3-4 s, and every stream waited. The loop keeps stepping
    while a grammar compiles and adds its request once it is ready; a request aborted while its grammar waits to
    compile is dropped (never compiled), its add answered; an invalid grammar is the add's error, as before."""
    engine = make_engine()
    may_finish = hold_grammar_compiles(monkeypatch, engine, timeout=30)  # a release per compile that may finish
    core = CoreThread(engine)
    stream = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True, output_kind=OutputKind.DELTA)
    choice = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputParams(choice=["yes", "no"]))
    core.commands.put(AddCommand(0, ["stream"], ["Once upon"], stream, 0.0))
    core.wait_for(lambda: core.tokens("stream") > 0)
    core.commands.put(AddCommand(1, ["held"], ["x"], choice, 0.0))
    core.commands.put(AddCommand(2, ["dropped"], ["y"], choice, 0.0))
    before = core.tokens("stream")
    core.wait_for(lambda: core.tokens("stream") >= before + 20)  # the loop steps while the grammar compiles
    assert core.added(1) is None and not known(engine, "held")
    core.commands.put(AbortCommand(["dropped"]))
    core.wait_for(lambda: core.added(2) is not None)
    assert core.added(2).error is not None  # type: ignore[union-attr]
    may_finish.release()
    core.wait_for(lambda: core.added(1) is not None)
    assert core.added(1).error is None  # type: ignore[union-attr]
    core.commands.put(AddCommand(3, ["bad"], ["z"], SamplingParams(structured_outputs={"regex": "(a"}), 0.0))
    may_finish.release()  # for "bad": the dropped add's grammar is not compiled
    core.wait_for(lambda: core.added(3) is not None)
    assert isinstance(core.added(3).error, InvalidParameterError)  # type: ignore[union-attr]
    core.wait_for(lambda: not engine.has_unfinished_requests())
    core.stop()
    assert core.tokens("held") > 0 and core.tokens("dropped") == 0 and engine.pool.num_used == 0


def known(engine: LLMEngine, request_id: str) -> bool:
    """Whether the engine holds the request (waiting or running)."""
    scheduler = engine.scheduler
    return request_id in scheduler.running or any(g.request_id == request_id for g in scheduler.waiting)


def test_the_grammar_queue_is_bounded_counted_as_waiting_and_freed_by_an_abort(monkeypatch: pytest.MonkeyPatch) -> None:
    """Adds queued for the grammar thread without bound, and their requests were neither waiting nor running in
    the load the gauges show. Beyond ``max_compiling`` an add is refused (a 429, as a full waiting queue); those
    queued count as waiting, and as compiling; an abort of one gives its place, and its count, back at once."""
    engine = make_engine()
    may_finish = hold_grammar_compiles(monkeypatch, engine, timeout=30)
    core = CoreThread(engine, max_compiling=2)
    choice = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputParams(choice=["yes", "no"]))
    core.commands.put(AddCommand(1, ["a-0", "a-1"], ["x", "y"], choice, 0.0))  # one compile for both prompts
    core.commands.put(AddCommand(2, ["b"], ["x"], choice, 0.0))
    core.commands.put(AddCommand(3, ["refused"], ["x"], choice, 0.0))
    core.wait_for(lambda: core.added(3) is not None)
    assert isinstance(core.added(3).error, QueueFullError)  # type: ignore[union-attr]
    assert "--max-compiling" in str(core.added(3).error)  # type: ignore[union-attr]
    core.wait_for(lambda: latest_load(core).num_compiling == 3)
    assert latest_load(core).num_waiting == 3 and not known(engine, "a-0")

    core.commands.put(AbortCommand(["b"]))  # waiting to compile: dropped, its place and count given back
    core.wait_for(lambda: core.added(2) is not None)
    assert core.added(2).error is not None and core.added(2).load.num_compiling == 2  # type: ignore[union-attr]
    core.commands.put(AddCommand(4, ["c"], ["x"], choice, 0.0))  # takes the place "b" gave back
    core.wait_for(lambda: latest_load(core).num_compiling == 3)
    core.commands.put(AbortCommand(["a-0", "a-1"]))  # compiling now: its result will be dropped
    core.wait_for(lambda: core.added(1) is not None)
    assert core.added(1).error is not None and core.added(1).load.num_compiling == 1  # type: ignore[union-attr]
    may_finish.release()  # a's compile, already running, ends for nothing
    may_finish.release()  # c's
    core.wait_for(lambda: core.added(4) is not None)
    assert core.added(4).error is None and core.added(4).load.num_compiling == 0  # type: ignore[union-attr]
    core.wait_for(lambda: not engine.has_unfinished_requests())
    core.stop()
    assert core.core.compiling == [] and engine.pool.num_used == 0
    assert core.tokens("c") > 0 and core.tokens("a-0") == core.tokens("b") == 0


def latest_load(core: CoreThread):  # type: ignore[no-untyped-def]
    """The load of the latest event that carries one."""
    return next(e.load for e in reversed(list(core.events)) if isinstance(e, Added | LoadChanged | Stepped))


def test_a_refused_add_frees_its_requests_without_a_garbage_collection() -> None:
    """An add refused with a 429 (its second request finds the waiting queue full): the request added first is
    rolled back, and neither request outlives the posted answer. Two cycles held the refused request until a full
    collection, which a serving process almost never runs: its samples point back at it, and the error, kept in a
    local of ``_add``'s frame, which its traceback holds, held ``add_request``'s frame."""
    engine = make_engine(max_num_seqs=1, max_waiting=1)
    groups: list[weakref.ref] = []
    add = engine.scheduler.add

    def tracked_add(group):  # type: ignore[no-untyped-def]
        groups.append(weakref.ref(group))
        add(group)

    engine.scheduler.add = tracked_add  # type: ignore[method-assign]
    engine.add_request("x", PARAMS, "running")
    errors: list[type] = []
    core = EngineCore(engine, lambda block: None, lambda event: errors.append(type(event.error)))  # type: ignore[union-attr]
    gc.collect()
    gc.disable()
    try:
        core._add(AddCommand(1, ["first", "refused"], ["a", "b"], PARAMS, 0.0))
        assert errors == [QueueFullError]
        assert len(groups) == 3 and groups[0]() is not None  # "running" is still queued
        assert [ref() for ref in groups[1:]] == [None, None]
    finally:
        gc.enable()
