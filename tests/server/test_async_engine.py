"""The async bridge: failure isolation between requests, an engine thread that loads the model and runs every
step and blocks when idle, one request id end to end, and a shutdown that fails pending requests instead of
hanging them."""

from __future__ import annotations

import asyncio
import json
import queue
import threading

import httpx
import pytest
import torch
from fastapi.testclient import TestClient

from rnnserve.engine.config import EngineConfig
from rnnserve.engine.llm_engine import LLMEngine
from rnnserve.engine.sampling_params import OutputKind, SamplingParams, StructuredOutputParams
from rnnserve.engine.scheduler import Scheduler
from rnnserve.engine.sequence import Sequence
from rnnserve.engine.structured_output import CompiledGrammar
from rnnserve.server.app import create_app
from rnnserve.server.async_engine import EngineDeadError, RequestFailedError
from rnnserve.server.background import serve_in_thread
from rnnserve.server.engine_core import EngineThread
from tests.server.conftest import hold_grammar_compiles, tiny_config

pytestmark = pytest.mark.timeout(90)


def sse_payloads(lines: list[str]) -> list[str]:
    return [line[len("data: ") :] for line in lines if line.startswith("data: ")]


def test_a_failing_request_ends_its_own_stream_only(monkeypatch: pytest.MonkeyPatch) -> None:
    real_append = Sequence.append_token
    running_when_failed: list[int] = []

    def append_token(self: Sequence, token_id, logprob):  # type: ignore[no-untyped-def]
        if self.group.prompt == "victim" and len(self.output_token_ids) == 3:
            running_when_failed.append(engine.load().num_running)
            raise ValueError("stop handling blew up")
        real_append(self, token_id, logprob)

    monkeypatch.setattr(Sequence, "append_token", append_token)
    # every token through append_token: a steady batch of plain samples appends its tokens for the whole batch
    monkeypatch.setattr(Scheduler, "_start_steady_append", lambda self, seqs, now: None)
    app = create_app(tiny_config())
    engine = app.state.engine.engine
    survivor = {"prompt": "Hello", "max_tokens": 300, "ignore_eos": True, "temperature": 0}

    async def scenario(url: str) -> tuple[list[str], list[str], int, dict]:
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            async with http.stream("POST", "/v1/completions", json={**survivor, "stream": True}) as running:
                lines = running.aiter_lines()
                survivor_events = [await anext(lines)]
                victim = await http.post("/v1/completions", json={"prompt": "victim", "max_tokens": 50, "stream": True,
                                                                   "ignore_eos": True})
                seen_when_victim_failed = len(survivor_events)
                survivor_events += [line async for line in lines]
            alone = (await http.post("/v1/completions", json=survivor)).json()
        return survivor_events, victim.text.splitlines(), seen_when_victim_failed, alone

    with serve_in_thread(app) as url:
        survivor_events, victim_lines, seen, alone = asyncio.run(scenario(url))
        metrics = httpx.get(f"{url}/metrics").text
    victim = sse_payloads(victim_lines)
    assert victim[-1] == "[DONE]"
    error = json.loads(victim[-2])["error"]
    assert error["type"] == "internal_error" and "stop handling blew up" in error["message"]
    assert running_when_failed == [2]  # the survivor was running in the same batch when the victim failed
    assert sse_payloads(survivor_events[seen:])
    events = sse_payloads(survivor_events)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
    assert chunks[-1]["finish_reason"] == "length"
    assert "".join(c["text"] for c in chunks) == alone["choices"][0]["text"]
    assert 'rnnserve_request_success_total{finished_reason="error",model_name="random:mingru-tiny"} 1.0' in metrics
    assert engine.pool.num_used == 0


class RecordingQueue(queue.SimpleQueue):
    """A command queue that shows whether its consumer is parked in a blocking ``get`` without a timeout."""

    def __init__(self) -> None:
        self.parked = threading.Event()
        self.timeouts: list[float | None] = []

    def get(self, block: bool = True, timeout: float | None = None):  # type: ignore[no-untyped-def]
        self.timeouts.append(timeout)
        if block:
            self.parked.set()
        try:
            return super().get(block, timeout)
        finally:
            self.parked.clear()


def test_idle_engine_thread_blocks_on_the_command_queue() -> None:
    app = create_app(tiny_config())
    bridge = app.state.engine
    engine = bridge.engine
    commands = RecordingQueue()
    bridge.driver.commands = commands
    steps: list[int] = []
    real_step = engine.step
    engine.step = lambda collect=True: steps.append(1) or real_step(collect)

    async def generate(request_id: str) -> None:
        submission = await bridge.submit(request_id, ["Hello"], SamplingParams(max_tokens=4))
        async for _ in submission.outputs():
            pass

    async def scenario() -> None:
        bridge.start(asyncio.get_running_loop())
        try:
            await generate("cmpl-first")
            assert await asyncio.to_thread(commands.parked.wait, 10)
            steps_when_idle = len(steps)
            assert commands.parked.is_set() and len(steps) == steps_when_idle
            assert set(commands.timeouts) == {None}  # never a timed wait: nothing polls
            await generate("cmpl-second")  # a command wakes it up
            assert len(steps) > steps_when_idle
        finally:
            await asyncio.to_thread(bridge.stop)

    asyncio.run(scenario())


def test_engine_request_ids_derive_from_the_response_id() -> None:
    app = create_app(tiny_config())
    engine = app.state.engine.engine
    added: list[str] = []
    real_add = engine.add_request

    def add_request(prompt, params, request_id=None, arrival_time=None, **options):  # type: ignore[no-untyped-def]
        added.append(request_id)
        return real_add(prompt, params, request_id, arrival_time, **options)

    engine.add_request = add_request
    with TestClient(app) as client:
        one = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).json()
        assert one["id"].startswith("cmpl-") and added == [one["id"]]
        added.clear()
        two = client.post("/v1/completions", json={"prompt": ["Hi", "Yo"], "max_tokens": 2}).json()
        assert added == [f"{two['id']}-0", f"{two['id']}-1"]
        added.clear()
        chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
        assert chat["id"].startswith("chatcmpl-") and added == [chat["id"]]


def test_stopping_fails_pending_requests_with_engine_dead() -> None:
    app = create_app(tiny_config(max_num_seqs=1))
    bridge = app.state.engine
    forever = SamplingParams(max_tokens=100_000, ignore_eos=True)

    async def scenario() -> None:
        bridge.start(asyncio.get_running_loop())
        running = await bridge.submit("cmpl-running", ["Hello"], forever)
        waiting = await bridge.submit("cmpl-waiting", ["Hello"], forever)
        outputs = running.outputs()
        await anext(outputs)
        await asyncio.to_thread(bridge.stop)
        with pytest.raises(EngineDeadError):
            async for _ in outputs:
                pass
        with pytest.raises(EngineDeadError):
            await anext(waiting.outputs())
        with pytest.raises(EngineDeadError):
            await bridge.submit("cmpl-late", ["Hello"], forever)

    asyncio.run(asyncio.wait_for(scenario(), 30))
    assert not bridge.running


def test_a_failed_step_leaves_the_bridge_holding_nothing_of_its_requests(monkeypatch: pytest.MonkeyPatch) -> None:
    """After a failed step the bridge kept each failed request's error until the request's final output came
    back from the abort (to count it as an error); a request that had none, its grammar still compiling, stayed
    there for the life of the server, one per such request and failure. The error now travels with the abort."""
    app = create_app(tiny_config())
    bridge, engine = app.state.engine, app.state.engine.engine
    may_finish = hold_grammar_compiles(monkeypatch, engine, timeout=30)
    held_compile, compiling, real_step = engine.grammars.compile, threading.Event(), engine.step
    failed: list[bool] = []

    def compile_and_say_so(constraint: StructuredOutputParams) -> CompiledGrammar:
        compiling.set()
        return held_compile(constraint)

    def step(collect: bool = True):  # type: ignore[no-untyped-def]
        if compiling.is_set() and not failed:  # once, while a grammar compiles
            failed.append(True)
            raise RuntimeError("device fell over")
        return real_step(collect)

    monkeypatch.setattr(engine.grammars, "compile", compile_and_say_so)
    monkeypatch.setattr(engine, "step", step)
    stream = SamplingParams(max_tokens=100_000, ignore_eos=True, output_kind=OutputKind.DELTA)
    constrained = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputParams(regex="[a-f]+"))

    def errors() -> float:
        labels = {"model_name": bridge.metrics.model_name, "finished_reason": "error"}
        return bridge.metrics.registry.get_sample_value("rnnserve_request_success_total", labels) or 0.0

    async def scenario() -> None:
        bridge.start(asyncio.get_running_loop())
        outputs = (await bridge.submit("cmpl-running", ["Hello"], stream)).outputs()
        await anext(outputs)
        with pytest.raises(RequestFailedError, match="device fell over"):  # its grammar compiles meanwhile
            await bridge.submit("cmpl-compiling", ["Hi"], constrained)
        with pytest.raises(RequestFailedError, match="device fell over"):
            async for _ in outputs:
                pass
        while errors() < 1:  # the abort ran (the compiling add dropped), the running request counted as an error
            await asyncio.sleep(0.01)
        may_finish.release(2)  # the dropped compile, and the next request's
        async for _ in (await bridge.submit("cmpl-after", ["Hi"], constrained)).outputs():  # the engine goes on
            pass
        await asyncio.to_thread(bridge.stop)

    asyncio.run(asyncio.wait_for(scenario(), 60))
    assert errors() == 1
    assert {name: value for name, value in vars(bridge).items() if isinstance(value, dict) and value} == {}


def test_async_scheduling_streams_the_same_text_as_a_synchronous_engine() -> None:
    """With async scheduling (the default on GPUs, forced on here) a step's outputs are the previous step's:
    every stream and every whole response still gets exactly the synchronous engine's text, the last outputs
    arrive once the engine has nothing left to run, and every slot is free at the end."""
    bodies = [{"prompt": p, "max_tokens": n, "ignore_eos": True, "temperature": 0}
              for p, n in (("a", 5), ("bb", 17), ("ccc", 9))]  # fmt: skip

    async def scenario(url: str) -> tuple[list[str], list[str]]:
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            whole = [(await http.post("/v1/completions", json=b)).json()["choices"][0]["text"] for b in bodies]

            async def stream(body: dict) -> str:
                response = await http.post("/v1/completions", json={**body, "stream": True})
                events = sse_payloads(response.text.splitlines())
                assert events[-1] == "[DONE]"
                return "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])

            return whole, list(await asyncio.gather(*(stream(b) for b in bodies)))

    texts = {}
    for mode in ("off", "on"):
        app = create_app(tiny_config(max_num_seqs=4, async_scheduling=mode))
        engine = app.state.engine.engine
        assert engine.async_scheduling is (mode == "on")
        with serve_in_thread(app) as url:
            texts[mode] = asyncio.run(scenario(url))
        assert engine.pool.num_used == 0 and not engine.has_unfinished_requests()
    whole, streamed = texts["on"]
    assert streamed == whole
    assert texts["on"] == texts["off"]


def test_the_engine_is_loaded_and_stepped_on_one_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CPU a second thread running parallel torch ops would start a second OpenMP team and slow every step:
    the thread that loads the model runs the steps, and it is not the caller's."""
    loaded_on: set[int] = set()
    stepped_on: set[int] = set()
    real_from_config = LLMEngine.from_config.__func__  # type: ignore[attr-defined]

    def from_config(cls: type[LLMEngine], config: EngineConfig) -> LLMEngine:
        loaded_on.add(threading.get_ident())
        engine = real_from_config(cls, config)
        real_step = engine.step

        def step(*args, **kwargs):  # type: ignore[no-untyped-def]
            stepped_on.add(threading.get_ident())
            return real_step(*args, **kwargs)

        engine.step = step
        return engine

    monkeypatch.setattr(LLMEngine, "from_config", classmethod(from_config))
    app = create_app(tiny_config())
    with TestClient(app) as client:
        assert client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3}).status_code == 200
        assert client.post("/v1/completions", json={"prompt": "Yo", "max_tokens": 3, "stream": True}).status_code == 200
    assert len(loaded_on) == 1 and stepped_on == loaded_on
    assert loaded_on != {threading.get_ident()}
    assert not app.state.engine.running


def test_engine_thread_runs_calls_in_order_with_the_creators_torch_threads() -> None:
    thread = EngineThread()
    try:
        assert thread.call(torch.get_num_threads) == torch.get_num_threads()
        ident = thread.call(threading.get_ident)
        assert ident != threading.get_ident() and thread.call(threading.get_ident) == ident
        with pytest.raises(ZeroDivisionError):
            thread.call(lambda: 1 / 0)
        assert thread.call(lambda x: x + 1, 41) == 42  # a failed call leaves the thread working
    finally:
        thread.close()
    with pytest.raises(RuntimeError, match="closed"):
        thread.submit(lambda: None)
