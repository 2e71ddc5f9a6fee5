"""The engine in a process of its own (``engine_process="on"``): the same answers as the engine in a thread, its
messages cross intact (outputs as plain rows, prompts once per request, errors with their types, session
states), and its death
fails in-flight requests with a clear error instead of hanging them."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import multiprocessing
import os
import pickle
import random
import signal
import socket
import struct
import threading
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from pathlib import Path

import httpx
import pytest
import torch
from fastapi.testclient import TestClient

from rnnserve.engine.config import EngineConfig
from rnnserve.engine.llm_engine import LLMEngine, StepStats
from rnnserve.engine.loader import ModelLoadError, build_random
from rnnserve.engine.outputs import RequestMetrics, RequestOutput
from rnnserve.engine.sampling_params import InvalidParameterError, OutputKind, SamplingParams
from rnnserve.engine.scheduler import QueueFullError
from rnnserve.engine.sequence import SequenceGroup
from rnnserve.engine.tokenizer import HFTokenizer
from rnnserve.server.app import create_app
from rnnserve.server.background import serve_in_thread
from rnnserve.server.engine_core import (
    MAX_UNHANDLED,
    SHUTDOWN_MESSAGE,
    AbortCommand,
    Aborted,
    AddCommand,
    Added,
    CommandSender,
    EncodedStep,
    EngineCore,
    EngineInfo,
    HandledCommand,
    Inbox,
    LoadChanged,
    OutputDecoder,
    OutputEncoder,
    ProcessDriver,
    ServerLinks,
    StepFailed,
    Stepped,
    StopCommand,
    Stopped,
    ThreadDriver,
    portable_error,
)
from tests.engine.conftest import make_engine
from tests.server.conftest import tiny_config
from tests.server.test_live import scrape

pytestmark = pytest.mark.timeout(180)

BODIES = [
    {"prompt": "Hello", "max_tokens": 12, "temperature": 0},
    {"prompt": "The cat", "max_tokens": 9, "temperature": 0.8, "seed": 7, "n": 2},
    {"prompt": "abc", "max_tokens": 6, "temperature": 0, "logprobs": 2, "echo": True},
    {"prompt": [5, 6, 7, 8], "max_tokens": 5, "temperature": 0, "prompt_logprobs": 1},
    {"prompt": ["one", "two"], "max_tokens": 4, "temperature": 0, "stop": ["e"]},
    {"prompt": "Hi", "max_tokens": 40, "temperature": 1.0, "seed": 3, "n": 2, "logit_bias": {"97": 5},
     "structured_outputs": {"regex": "[a-f]{3,9}"}},  # fmt: skip
]
VOLATILE = {"id", "created"}


def stable(body: dict) -> dict:
    return {k: v for k, v in body.items() if k not in VOLATILE}


def streamed_chunks(client: TestClient, body: dict) -> list[dict]:
    response = client.post("/v1/completions", json={**body, "stream": True})
    assert response.status_code == 200, response.text
    payloads = [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")]
    assert payloads[-1] == "[DONE]"
    return [stable(json.loads(p)) for p in payloads[:-1]]


def streamed_text(chunks: list[dict]) -> dict[int, str]:
    texts: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    return texts


def answers(engine_process: str) -> tuple[list[dict], list[dict[int, str]], dict]:
    app = create_app(tiny_config(engine_process=engine_process))
    assert (app.state.engine.engine is None) is (engine_process == "on")
    with TestClient(app) as client:
        whole = [stable(client.post("/v1/completions", json=b).json()) for b in BODIES]
        streams = [streamed_text(streamed_chunks(client, b)) for b in BODIES]
        chat = stable(
            client.post(
                "/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "temperature": 0},
            ).json()
        )
    return whole, streams, chat


@pytest.fixture(scope="module")
def process_client() -> Iterator[TestClient]:
    with TestClient(create_app(tiny_config(engine_process="on", max_num_seqs=2, max_waiting=1))) as client:
        yield client


def test_a_process_engine_answers_as_a_thread_engine() -> None:
    whole, streams, chat = answers("on")
    assert (whole, streams, chat) == answers("off")
    assert all(w.get("choices") for w in whole)
    for body, streamed in zip(whole, streams, strict=True):
        assert {c["index"]: c["text"] for c in body["choices"]} == streamed


def test_metrics_and_load_are_kept_by_the_server_process(process_client: TestClient) -> None:
    before = process_client.get("/metrics").text
    body = {"prompt": "Hi", "max_tokens": 5, "ignore_eos": True}  # sampled: an early EOS would end it short
    assert process_client.post("/v1/completions", json=body).status_code == 200
    after = process_client.get("/metrics").text
    for name, added in [("rnnserve_generation_tokens_total", 5), ("rnnserve_request_success_total", 1)]:
        assert metric(after, name) == metric(before, name) + added
    assert metric(after, "rnnserve_state_slots") == 2
    assert metric(after, "rnnserve_state_slots_used") == 0
    assert process_client.get("/ready").status_code == 200


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_the_server_processes_series_count_the_engine_process(process_client: TestClient) -> None:
    """process_* describe the HTTP server alone: with the engine in a process of its own they missed almost all
    of the CPU (its step) and most of the memory (the model)."""
    engine_pid = process_client.app.state.engine.driver.pid  # type: ignore[attr-defined]
    body = {"prompt": "Hi", "max_tokens": 40, "ignore_eos": True}
    assert process_client.post("/v1/completions", json=body).status_code == 200
    page = process_client.get("/metrics").text
    assert metric(page, "rnnserve_server_processes") >= 2
    with open(f"/proc/{engine_pid}/statm") as statm:
        engine_rss = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    total_rss = metric(page, "rnnserve_server_processes_resident_memory_bytes")
    assert total_rss >= metric(page, "process_resident_memory_bytes") + 0.9 * engine_rss
    with open(f"/proc/{engine_pid}/stat") as stat:
        engine_cpu = sum(map(int, stat.read().rsplit(")", 1)[1].split()[11:13])) / os.sysconf("SC_CLK_TCK")
    total_cpu = metric(page, "rnnserve_server_processes_cpu_seconds_total")
    assert total_cpu >= metric(page, "process_cpu_seconds_total") + engine_cpu - 0.05


def test_errors_raised_in_the_engine_process_keep_their_status(process_client: TestClient) -> None:
    bad_token = process_client.post("/v1/completions", json={"prompt": [10**6], "max_tokens": 2})
    assert bad_token.status_code == 400
    assert bad_token.json()["error"]["param"] == "prompt"
    bad_schema = {"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 5}}}}
    bad_grammar = process_client.post("/v1/completions", json=bad_schema)  # compiled in the engine process
    assert bad_grammar.status_code == 400 and bad_grammar.json()["error"]["param"] == "response_format"


def test_sessions_carry_state_across_the_process_boundary(tmp_path: os.PathLike) -> None:
    turns = ["Hello", " there", " again"]

    def conversation(engine_process: str) -> list[str]:
        config = tiny_config(engine_process=engine_process, session_dir=str(tmp_path / engine_process))
        with TestClient(create_app(config)) as client:
            session = client.post("/v1/sessions", json={}).json()["id"]
            texts = []
            for turn in turns:
                body = {"prompt": turn, "max_tokens": 6, "temperature": 0, "session_id": session}
                response = client.post("/v1/completions", json=body)
                assert response.status_code == 200, response.text
                texts.append(response.json()["choices"][0]["text"])
            return texts

    assert conversation("on") == conversation("off")


def test_a_load_error_is_raised_by_create_app() -> None:
    with pytest.raises(ModelLoadError):
        create_app(tiny_config(model="random:no-such-preset", engine_process="on"))


def test_in_flight_streams_fail_cleanly_when_the_engine_process_dies(caplog: pytest.LogCaptureFixture) -> None:
    app = create_app(tiny_config(engine_process="on"))
    pid = app.state.engine.driver.pid

    async def scenario(url: str) -> tuple[str, int, int, int]:
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            body = {"prompt": "Hi", "max_tokens": 100_000, "ignore_eos": True, "stream": True}
            async with http.stream("POST", "/v1/completions", json=body) as response:
                lines = response.aiter_lines()
                while not (await anext(lines)).startswith("data: {"):
                    pass
                os.kill(pid, signal.SIGKILL)
                rest = [line async for line in lines]
            health = (await http.get("/health")).status_code
            ready = (await http.get("/ready")).status_code
            late = (await http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})).status_code
            return "\n".join(rest), health, ready, late

    with serve_in_thread(app) as url:
        rest, health, ready, late = asyncio.run(scenario(url))
        metrics = scrape(url)
    assert "the engine process exited" in rest and rest.rstrip().endswith("data: [DONE]")
    assert (health, ready, late) == (503, 503, 503)
    # the failed stream is an error, and the load gauges do not freeze at the load before the death
    assert metrics['rnnserve_request_success_total{finished_reason="error"}'] == 1
    assert metrics["rnnserve_num_requests_running"] == metrics["rnnserve_state_slots_used"] == 0
    # the log says so (it said nothing: a server answering 503 to everything, with no reason given)
    assert any(r.levelname == "ERROR" and "the engine stopped" in r.getMessage() for r in caplog.records)


def engine_failing_on_step_3(config: EngineConfig) -> LLMEngine:
    """An engine factory for the engine process (importable there): its third step raises."""
    engine = LLMEngine.from_config(config)
    real_step, calls = engine.step, itertools.count(1)

    def step(collect: bool = True):  # type: ignore[no-untyped-def]
        if next(calls) == 3:
            raise RuntimeError("device fell over")
        return real_step(collect)

    engine.step = step  # type: ignore[method-assign]
    return engine


def metric(text: str, name: str) -> float:
    """The sum of a metric's samples (over its labels) in a Prometheus text page."""
    samples = [line for line in text.splitlines() if line.startswith((name + " ", name + "{"))]
    assert samples, name
    return sum(float(line.rsplit(" ", 1)[1]) for line in samples)


def metric_at(url: str, name: str) -> float:
    return metric(httpx.get(f"{url}/metrics").text, name)


def test_a_failed_step_in_the_engine_process_fails_its_requests_alone() -> None:
    app = create_app(tiny_config(engine_process="on"), engine_factory=engine_failing_on_step_3)
    with TestClient(app) as client:
        body = {"prompt": "Hello", "max_tokens": 50, "ignore_eos": True, "stream": True}
        lines = [line for line in client.post("/v1/completions", json=body).text.splitlines() if line]
        assert lines[-1] == "data: [DONE]"
        assert "device fell over" in json.loads(lines[-2].removeprefix("data: "))["error"]["message"]
        after = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3, "ignore_eos": True})
        assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 3
        page = client.get("/metrics").text
        assert metric(page, "rnnserve_state_slots_used") == 0
        # the failed request's client got an error: so do the error-rate alert and dashboards (it was an abort)
        finished = {line.split('finished_reason="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
                    for line in page.splitlines() if line.startswith("rnnserve_request_success_total{")}  # fmt: skip
        assert finished["error"] == 1 and finished["abort"] == 0, finished


def test_a_disconnected_stream_frees_its_slot_in_the_engine_process() -> None:
    app = create_app(tiny_config(engine_process="on"))

    async def scenario(url: str) -> tuple[float, float]:
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            body = {"prompt": "Hi", "max_tokens": 100_000, "ignore_eos": True, "stream": True, "n": 2}
            async with http.stream("POST", "/v1/completions", json=body) as response:
                lines = response.aiter_lines()
                while not (await anext(lines)).startswith("data: {"):
                    pass
                busy = await asyncio.to_thread(metric_at, url, "rnnserve_state_slots_used")
        for _ in range(100):
            if await asyncio.to_thread(metric_at, url, "rnnserve_state_slots_used") == 0:
                break
            await asyncio.sleep(0.05)
        return busy, await asyncio.to_thread(metric_at, url, "rnnserve_num_requests_running")

    with serve_in_thread(app) as url:
        busy, running = asyncio.run(scenario(url))
        assert busy == 2 and running == 0
        assert metric_at(url, "rnnserve_state_slots_used") == 0


def lockstep_engines() -> tuple[LLMEngine, LLMEngine]:
    """Two engines over the same model (random:mingru-tiny on CPU): given the same requests, they step alike."""
    model, tokenizer = build_random("mingru-tiny", torch.device("cpu"), torch.float32)
    config = EngineConfig(max_num_seqs=8, max_num_batched_tokens=64)
    return LLMEngine(model, tokenizer, config), LLMEngine(model, tokenizer, config)


def without_times(out: RequestOutput) -> RequestOutput:
    return dataclasses.replace(out, metrics=RequestMetrics(0.0))


def test_rows_built_from_the_requests_decode_to_the_engines_outputs_with_each_prompt_sent_once() -> None:
    """What the engine process sends (``OutputEncoder.row`` straight from each request, the compact outputs of
    streams in bulk as columns) decodes to exactly what ``collect_outputs`` builds, step after step: output kinds,
    n > 1, logprobs, prompt logprobs, stop strings, a stream's compact outputs (its metrics as of its last full
    row), a request finishing and its id coming back."""
    objects_engine, rows_engine = lockstep_engines()
    encoder, decoder = OutputEncoder(), OutputDecoder()
    requests = [
        ("a", "Hello", SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=7, logprobs=2, prompt_logprobs=1,
                                      output_kind=OutputKind.DELTA, ignore_eos=True)),
        ("b", [5, 6, 7], SamplingParams(temperature=0, max_tokens=4, stop=["e"], output_kind=OutputKind.CUMULATIVE)),
        ("c", "Hi", SamplingParams(temperature=0, max_tokens=3, output_kind=OutputKind.FINAL_ONLY, ignore_eos=True)),
        ("d", "Hey", SamplingParams(temperature=0, max_tokens=6, stop=["x"], output_kind=OutputKind.DELTA,
                                    ignore_eos=True)),
    ]  # fmt: skip
    for engine in (objects_engine, rows_engine):
        for request_id, prompt, params in requests:
            engine.add_request(prompt, params, request_id)
    prompts_sent: dict[str, int] = {}
    compact = 0
    again = SamplingParams(temperature=0, max_tokens=2, output_kind=OutputKind.DELTA)
    readded = False
    while objects_engine.has_unfinished_requests():
        expected = objects_engine.step()
        rows_engine.step(collect=False)
        rows = rows_engine.collect(encoder.row, bulk=encoder.take_deltas)
        columns = encoder.take_columns()
        assert set(columns) <= {None}  # no server owns them here
        rows, deltas = pickle.loads(pickle.dumps((rows, columns.get(None, [])), protocol=pickle.HIGHEST_PROTOCOL))
        decoded = decoder.decode(rows, deltas)
        compact += len(deltas) // 3
        by_id = {out.request_id: out for out in expected}  # full rows first, then the columns'
        assert [without_times(out) for out in decoded] == [without_times(by_id[out.request_id]) for out in decoded]
        assert len(decoded) == len(expected)
        for row, got in zip(rows, decoded, strict=False):  # the clocks differ, the times' presence not
            want = by_id[got.request_id]
            assert [t is None for t in dataclasses.astuple(got.metrics)] == [
                t is None for t in dataclasses.astuple(want.metrics)
            ]
            prompts_sent[row[0]] = prompts_sent.get(row[0], 0) + (row[1] is not None)
        if not readded and any(out.request_id == "b" and out.finished for out in expected):
            readded = True  # the id comes back as a new request, whose prompt crosses again
            for engine in (objects_engine, rows_engine):
                engine.add_request("again", again, "b")
    assert not rows_engine.has_unfinished_requests()
    assert prompts_sent == {"a": 1, "b": 2, "c": 1, "d": 1}
    assert compact == 4  # d's outputs between its first and its last
    assert not encoder.sent and not encoder.compact and not decoder.known and not decoder.streams


def add_command(add_id: int, *request_ids: str) -> AddCommand:
    return AddCommand(add_id, list(request_ids), ["x"] * len(request_ids), SamplingParams(), 0.0)


def test_events_cross_as_messages_with_outputs_as_the_rows_they_hold() -> None:
    server_end, engine_end = multiprocessing.Pipe()
    links = ServerLinks([engine_end])
    server_end.send_bytes(pickle.dumps([add_command(3, "a")]))
    assert links.next_command(True) == add_command(3, "a")
    rows = [("a", None, [], False, (1.0,), None, 0, None)]
    stats = [StepStats(generated_tokens=2), StepStats(generated_tokens=1)]
    links.post(Stepped(rows, stats, None))  # type: ignore[arg-type]
    message = pickle.loads(server_end.recv_bytes())
    assert isinstance(message, EncodedStep) and message.steps == stats and message.rows == rows

    class Local(Exception):  # cannot be unpickled by the server
        pass

    links.post(Added(3, ["a"], Local("odd"), None))  # type: ignore[arg-type]
    added = pickle.loads(server_end.recv_bytes())
    assert isinstance(added.error, RuntimeError) and str(added.error) == "Local: odd"
    assert links.owners == {}  # nothing was added
    links.encoder.sent.update(["a", "b"])
    final = RequestOutput("a", None, [1], [], True, RequestMetrics(1.0))
    links.post(Aborted([final], None))  # type: ignore[arg-type]
    assert isinstance(pickle.loads(server_end.recv_bytes()), Aborted) and links.encoder.sent == {"b"}


def test_an_event_that_cannot_be_sent_raises_and_a_closed_pipe_does_not() -> None:
    """A pickling failure reaches the engine loop, which stops and reports it (never a silent hang); a
    closed pipe means the server is gone, which the loop learns from its next command read."""
    server_end, engine_end = multiprocessing.Pipe()
    links = ServerLinks([engine_end])
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        links.post(StepFailed(lambda: None))  # type: ignore[arg-type]
    server_end.close()
    links.post(Stepped([("a", None, [], False)], [], None))  # type: ignore[arg-type, list-item]
    assert links.next_command(True) == StopCommand()  # the server is gone


def test_each_server_gets_its_own_requests_outputs_and_the_step_stats_are_sent_once() -> None:
    pipes = [multiprocessing.Pipe() for _ in range(2)]
    servers = [server_end for server_end, _ in pipes]
    links = ServerLinks([engine_end for _, engine_end in pipes])
    for index, server in enumerate(servers):  # the add ids are each server's own: the same number is no clash
        server.send_bytes(pickle.dumps([add_command(1, f"s{index}a", f"s{index}b")]))
    for step in range(2):
        command = links.next_command(True)
        assert isinstance(command, AddCommand)
        links.post(Added(1, command.request_ids, None, f"load {step}"))  # type: ignore[arg-type]
        owner = int(command.request_ids[0][1])
        assert pickle.loads(servers[owner].recv_bytes()) == Added(1, command.request_ids, None, f"load {step}")  # type: ignore[arg-type]
        # the other server's gauges follow the engine's load too (they kept a cancelled stream's slot before)
        assert pickle.loads(servers[1 - owner].recv_bytes()) == LoadChanged(f"load {step}")  # type: ignore[arg-type]
    assert not any(server.poll() for server in servers)

    rows = [(request_id, None, [], request_id == "s1b") for request_id in ("s0a", "s1b", "gone", "s0b")]
    deltas = {0: [4, " more", [7]], 2: [9, "x", [1]]}  # compact outputs: server 0's, and one of a server gone
    stats = [StepStats(generated_tokens=3)]
    links.post(Stepped(rows, stats, "load", deltas))  # type: ignore[arg-type]
    first, second = (pickle.loads(server.recv_bytes()) for server in servers)
    assert (first.rows, first.steps, first.load, first.deltas) == ([rows[0], rows[3]], stats, "load", deltas[0])
    assert (second.rows, second.steps, second.load, second.deltas) == ([rows[1]], [], "load", [])
    assert "s1b" not in links.owners  # finished

    assert links.unhandled == {0: 1, 1: 1}
    servers[0].send_bytes(pickle.dumps([HandledCommand()]))
    handled = links.next_command(False)  # each server's frees its own window, whatever the other holds
    assert handled == HandledCommand() and links.next_command(False) is None
    links.handled(handled)  # type: ignore[arg-type]
    assert links.unhandled == {0: 0, 1: 1}
    servers[1].send_bytes(pickle.dumps([HandledCommand()]))
    links.handled(links.next_command(False))  # type: ignore[arg-type]
    assert links.unhandled == {0: 0, 1: 0}

    links.post(Stepped([], [], "load"))  # type: ignore[arg-type]
    servers[1].send_bytes(pickle.dumps([StopCommand()]))
    servers[0].send_bytes(pickle.dumps([HandledCommand()]))
    commands = []
    for _ in range(2):  # the stopped server's request, and the other's handled message
        commands.append(links.next_command(True))
        if isinstance(commands[-1], AbortCommand):
            links.post(Aborted([], "load"))  # type: ignore[arg-type]  # for a server that is gone: not sent
        else:
            links.handled(commands[-1])  # type: ignore[arg-type]
    assert sorted(commands, key=repr) == [AbortCommand(["s1a"]), HandledCommand()]
    assert links.unhandled == {0: 0}
    assert isinstance(pickle.loads(servers[1].recv_bytes()), EncodedStep)
    assert pickle.loads(servers[1].recv_bytes()).message == SHUTDOWN_MESSAGE  # Stopped, and nothing after it
    assert not servers[1].poll()
    assert pickle.loads(servers[0].recv_bytes()).rows == []
    assert pickle.loads(servers[0].recv_bytes()) == LoadChanged("load")  # type: ignore[arg-type]  # the abort's

    links.post(StepFailed("boom"))
    assert pickle.loads(servers[0].recv_bytes()) == StepFailed("boom")
    servers[0].close()  # gone without a stop: its requests are aborted, then the loop stops
    assert links.next_command(True) == AbortCommand(["s0a", "s0b"])
    assert links.next_command(True) == StopCommand()


class LinkedServer:
    """A server's end of a pipe to an engine loop run by :class:`ServerLinks`: what it reads, decoded."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.decoder = OutputDecoder()
        self.tokens: dict[str, list[int]] = {}
        self.finished: set[str] = set()
        self.unhandled = 0  # EncodedStep messages read and not acknowledged

    def send(self, *commands: object) -> None:
        self.conn.send_bytes(pickle.dumps(list(commands)))

    def read(self, timeout: float = 10.0) -> object:
        """The next message (decoding a step's outputs), which must come within ``timeout`` seconds."""
        assert self.conn.poll(timeout), "the engine sent this server nothing"
        message = pickle.loads(self.conn.recv_bytes())
        if isinstance(message, EncodedStep):
            self.unhandled += 1
            for out in self.decoder.decode_step(message):
                self.tokens.setdefault(out.request_id, []).extend(out.outputs[0].new_token_ids)
                if out.finished:
                    self.finished.add(out.request_id)
        return message

    def serve_until(self, request_ids: set[str]) -> list[object]:
        """Read and handle every message until ``request_ids`` finished; the messages read."""
        messages = []
        while not request_ids <= self.finished:
            messages.append(self.read())
            self.handle_all()
        return messages

    def handle_all(self) -> None:
        self.send(*[HandledCommand()] * self.unhandled)
        self.unhandled = 0

    def pending(self) -> list[object]:
        """The messages waiting in the pipe, read without handling them (a busy or blocked event loop)."""
        messages = []
        while self.conn.poll(0.5):
            messages.append(self.read())
        return messages


def test_a_server_that_stops_handling_its_outputs_holds_back_its_own_requests_only() -> None:
    """With several API servers each has its own window of unhandled outputs: one that stops handling them
    (a stopped process, a blocked event loop) leaves the other's streams flowing to their end and its pipe
    takes no more than that window (the load it is due waits for it, however many requests the other adds);
    its own requests keep running (one that finishes frees its slot), and their outputs come whole, merged,
    once it handles what it holds."""
    engine = make_engine()
    pipes = [multiprocessing.Pipe() for _ in range(2)]
    healthy, stalled = (LinkedServer(server_end) for server_end, _ in pipes)
    links = ServerLinks([engine_end for _, engine_end in pipes])
    core = EngineCore(engine, links.next_command, links.post, links.encoder.row, links, encoder=links.encoder)
    loop = threading.Thread(target=core.run, daemon=True)
    loop.start()
    try:
        serve_a_healthy_and_a_stalled_server(engine, healthy, stalled)
    finally:
        for server in (healthy, stalled):  # closed, the pipes stop the loop
            server.conn.close()
        loop.join(10)
    assert not loop.is_alive()


def serve_a_healthy_and_a_stalled_server(engine: LLMEngine, healthy: LinkedServer, stalled: LinkedServer) -> None:
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, output_kind=OutputKind.DELTA)
    stalled.send(AddCommand(0, ["s"], ["The cat"], params, 0.0))
    assert isinstance(stalled.read(), Added)
    healthy.send(AddCommand(0, ["h"], ["The cat"], params, 0.0))
    # The stalled server reads (its event loop would not handle) whatever comes; the healthy one streams to the end.
    healthy.serve_until({"h"})
    assert len(healthy.tokens["h"]) == 40
    one_token = SamplingParams(temperature=0, max_tokens=1, output_kind=OutputKind.DELTA)
    healthy.send(*[AddCommand(add_id, [f"h{add_id}"], ["x"], one_token, 0.0) for add_id in range(1, 201)])
    healthy.serve_until({f"h{add_id}" for add_id in range(1, 201)})
    held = stalled.pending()
    assert stalled.unhandled == MAX_UNHANDLED  # its window's messages, and no LoadChanged per add of the other's
    assert len(held) <= MAX_UNHANDLED + 2, [type(message).__name__ for message in held]
    assert "s" not in stalled.finished and engine.pool.num_used == 0  # "s" finished: its output waits, not its slot

    stalled.handle_all()  # it resumes
    assert isinstance(stalled.read(), LoadChanged)  # the load it was due
    resumed = stalled.serve_until({"s"})
    assert stalled.tokens["s"] == healthy.tokens["h"]  # nothing lost: the same prompt, greedy
    assert len([message for message in resumed if isinstance(message, EncodedStep)]) == 1  # all it missed, merged


def test_commands_queued_together_cross_as_one_message_and_a_stop_ends_the_sender() -> None:
    server_end, engine_end = multiprocessing.Pipe()
    sender = CommandSender(server_end)
    commands = [AbortCommand(["a"]), HandledCommand(), AbortCommand(["b", "c"])]
    for command in commands:
        sender.send(command)  # queued before the thread starts: one batch
    sender.thread.start()
    assert pickle.loads(engine_end.recv_bytes()) == commands
    sender.send(StopCommand())
    sender.send(AbortCommand(["late"]))
    sender.thread.join(10)
    assert not sender.thread.is_alive()
    assert StopCommand() in pickle.loads(engine_end.recv_bytes())
    engine_end.close()
    closed = CommandSender(server_end)  # a pipe whose engine end is gone ends the thread, not the server
    closed.thread.start()
    closed.send(HandledCommand())
    closed.thread.join(10)
    assert not closed.thread.is_alive()


def test_errors_cross_with_their_types_and_fields() -> None:
    invalid = pickle.loads(pickle.dumps(portable_error(InvalidParameterError("top_k", "must be positive"))))
    assert isinstance(invalid, InvalidParameterError)
    assert (invalid.param, str(invalid)) == ("top_k", "must be positive")
    assert isinstance(pickle.loads(pickle.dumps(portable_error(QueueFullError("full")))), QueueFullError)

    class Local(Exception):  # not importable by name: cannot be unpickled
        pass

    fallback = portable_error(Local("odd"))
    assert type(fallback) is RuntimeError and str(fallback) == "Local: odd"


def test_engine_info_describes_the_same_engine_in_both_places() -> None:
    app = create_app(tiny_config())
    thread_info = app.state.engine.info
    app.state.engine.stop()
    driver = ProcessDriver.spawn(tiny_config().engine)
    try:
        process_info = driver.info
    finally:
        driver.stop(10.0)
    assert isinstance(app.state.engine.driver, ThreadDriver)
    same = {f.name for f in dataclasses.fields(EngineInfo)} - {"tokenizer", "load"}
    assert {n: getattr(process_info, n) for n in same} == {n: getattr(thread_info, n) for n in same}
    assert process_info.tokenizer.encode("héllo") == thread_info.tokenizer.encode("héllo")


def test_a_hugging_face_tokenizer_crosses_to_the_server_process(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    raw = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2, "</s>": 3}, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.save(str(tmp_path / "tokenizer.json"))
    config = {"eos_token": "</s>", "chat_template": "{{ messages[0]['content'] }}"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = HFTokenizer(tmp_path / "tokenizer.json")
    crossed = pickle.loads(pickle.dumps(tokenizer))
    assert crossed.encode("hello world") == tokenizer.encode("hello world") == [1, 2]
    assert crossed.decode([2, 1]) == "world hello" and crossed.vocab_size == 4
    assert (crossed.eos_token_id, crossed.chat_template) == (3, config["chat_template"])



def test_an_add_answered_later_goes_to_the_server_that_sent_it() -> None:
    """An add with a grammar is answered once the grammar compiled, while the loop may run another server's
    command: its Added went to that other server, whose add ids are its own, and the sender waited forever."""
    pipes = [multiprocessing.Pipe() for _ in range(2)]
    servers = [server_end for server_end, _ in pipes]
    links = ServerLinks([engine_end for _, engine_end in pipes])
    servers[0].send_bytes(pickle.dumps([add_command(7, "s0a")]))
    assert links.next_command(True) == add_command(7, "s0a")  # its grammar compiles: no answer yet
    servers[1].send_bytes(pickle.dumps([add_command(7, "s1a")]))
    assert links.next_command(True) == add_command(7, "s1a")
    links.post(Added(7, ["s0a"], InvalidParameterError("regex", "invalid"), "load"))  # type: ignore[arg-type]
    answer = pickle.loads(servers[0].recv_bytes())
    assert isinstance(answer, Added) and answer.request_ids == ["s0a"] and answer.error.param == "regex"
    assert pickle.loads(servers[1].recv_bytes()) == LoadChanged("load")  # type: ignore[arg-type]
    assert links.owners == {"s1a": 1}
    links.post(Added(7, ["s1a"], None, "load"))  # type: ignore[arg-type]
    assert pickle.loads(servers[1].recv_bytes()) == Added(7, ["s1a"], None, "load")  # type: ignore[arg-type]
    assert pickle.loads(servers[0].recv_bytes()) == LoadChanged("load")  # type: ignore[arg-type]


BIG_PROMPT_TEXT = "x" * (4 << 20)  # far more than a pipe holds (a few hundred KB)


def with_a_big_first_row(row_of: Callable[[SequenceGroup], tuple]) -> Callable[[SequenceGroup], tuple]:
    """``row_of`` whose first row of request ``big`` carries a prompt text of 4 MiB (a message no pipe holds)."""

    def build(group: SequenceGroup) -> tuple:
        row = row_of(group)
        if group.request_id == "big" and row[1] is not None:
            row = (row[0], (BIG_PROMPT_TEXT, *row[1][1:]), *row[2:])
        return row

    return build


def frames(data: bytearray) -> Iterator[object]:
    """The messages ``send_bytes`` framed in ``data`` that are complete, each removed from it."""
    while len(data) >= 4:
        (size,) = struct.unpack("!i", data[:4])
        if len(data) < 4 + size:
            return
        message = pickle.loads(data[4 : 4 + size])
        del data[: 4 + size]
        yield message


def test_a_server_stopped_halfway_through_a_large_message_holds_back_no_other() -> None:
    """The engine wrote each message with a blocking send: a server that stopped reading halfway through one
    larger than its pipe (a stopped process, a blocked reader) stopped the engine loop, and every server's streams
    with it. Its bytes now wait for it, the loop steps for the others, and they reach it intact once it reads."""
    engine = make_engine()
    pipes = [multiprocessing.Pipe() for _ in range(2)]
    (slow_conn, _), (healthy_conn, _) = pipes
    healthy = LinkedServer(healthy_conn)
    links = ServerLinks([engine_end for _, engine_end in pipes])
    core = EngineCore(engine, links.next_command, links.post, with_a_big_first_row(links.encoder.row), links,
                      encoder=links.encoder)
    loop = threading.Thread(target=core.run, daemon=True)
    loop.start()
    try:
        params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, output_kind=OutputKind.DELTA)
        slow_conn.send_bytes(pickle.dumps([AddCommand(0, ["big"], ["The cat"], params, 0.0)]))
        received = bytearray()
        while len(received) < 1 << 20:  # it reads a quarter of the big message, then stops
            assert slow_conn.poll(30), "the engine sent the slow server nothing"
            received += os.read(slow_conn.fileno(), (1 << 20) - len(received))
        healthy.send(AddCommand(0, ["h"], ["Hello"], dataclasses.replace(params, max_tokens=20), 0.0))
        healthy.serve_until({"h"})
        assert len(healthy.tokens["h"]) == 20

        decoder, big_outputs = OutputDecoder(), []  # it resumes: every message whole, in order
        while True:
            for message in frames(received):
                if isinstance(message, EncodedStep):
                    big_outputs += decoder.decode_step(message)
                    slow_conn.send_bytes(pickle.dumps([HandledCommand()]))
            if big_outputs and big_outputs[-1].finished:
                break
            assert slow_conn.poll(30), "the engine sent the slow server nothing more"
            received += os.read(slow_conn.fileno(), 1 << 20)
        assert big_outputs[0].prompt == BIG_PROMPT_TEXT
        assert sum(len(out.outputs[0].new_token_ids) for out in big_outputs) == 3
    finally:
        for server_end, _ in pipes:
            server_end.close()
        loop.join(30)
    assert not loop.is_alive() and engine.pool.num_used == 0


def framed(payload: bytes, long_header: bool = False) -> bytes:
    """``payload`` framed as ``Connection.send_bytes`` frames it (``long_header``: as it frames 2 GiB or more)."""
    if long_header:
        return struct.pack("!iQ", -1, len(payload)) + payload
    return struct.pack("!i", len(payload)) + payload


def write_raw(conn: Connection, data: bytes) -> None:
    """Write ``data`` into ``conn``'s pipe as it is (no framing), all of it."""
    with socket.socket(fileno=os.dup(conn.fileno())) as sock:
        sock.sendall(data)


def test_an_inbox_returns_whole_messages_only_however_their_bytes_arrive() -> None:
    """Messages sent in pieces cut anywhere (inside a header too), small and larger than the inbox, with either
    header, come out whole and once each, in order; the room a large one took is given back; the end of the pipe
    is EOFError, also halfway through a message."""
    messages: list[object] = [[HandledCommand()], [add_command(1, "a")], ["x" * 300_000], [AbortCommand(["b"])]]
    frames = [framed(pickle.dumps(m), long_header=i == 3) for i, m in enumerate(messages)]
    stream = b"".join(frames) + framed(pickle.dumps(["never whole"]))[:-1]
    ends = list(itertools.accumulate(len(frame) for frame in frames))  # a cut there: nothing begun is left
    cuts = sorted({*random.Random(0).sample(range(1, len(stream)), 200), 1, 2, 3, 5, 9, *ends})
    writer, reader = socket.socketpair()
    inbox = Inbox(reader)
    received: list[object] = []
    try:
        assert inbox.read() is None  # nothing to read: no wait
        for begin, end in itertools.pairwise([0, *cuts, len(stream)]):
            writer.sendall(stream[begin:end])
            while (whole := inbox.read()) is not None:
                received += whole
        assert received == messages and inbox.partial
        assert len(inbox.buffer) == 65536
        writer.close()
        with pytest.raises(EOFError):
            inbox.read()
    finally:
        writer.close()
        reader.close()


def test_a_server_stopped_halfway_through_writing_a_command_holds_back_no_other() -> None:
    """The engine read each command with a blocking ``recv_bytes``: a server that stopped halfway through writing
    a large one (a stopped process, a crash mid-write) stopped the engine loop, and every server's streams with
    it. Its part waits for the rest, the loop serves the others, and the command runs once it is whole."""
    engine = make_engine()
    pipes = [multiprocessing.Pipe() for _ in range(2)]
    (slow_conn, _), (healthy_conn, _) = pipes
    slow, healthy = LinkedServer(slow_conn), LinkedServer(healthy_conn)
    links = ServerLinks([engine_end for _, engine_end in pipes])
    core = EngineCore(engine, links.next_command, links.post, links.encoder.row, links)
    loop = threading.Thread(target=core.run, daemon=True)
    loop.start()
    try:
        params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, output_kind=OutputKind.DELTA)
        long_prompt = "The cat " * 100_000  # an add of 800 KB
        frame = framed(pickle.dumps([AddCommand(0, ["big"], [long_prompt], params, 0.0)]))
        write_raw(slow_conn, frame[:4096])  # its header and a little of the rest
        healthy.send(AddCommand(0, ["h"], ["Hello"], dataclasses.replace(params, max_tokens=20), 0.0))
        assert isinstance(healthy.read(), Added)
        healthy.serve_until({"h"})
        assert len(healthy.tokens["h"]) == 20 and links.inboxes[0].partial
        write_raw(slow_conn, frame[4096:] + framed(pickle.dumps([AbortCommand(["nothing"])])))  # the rest
        messages = [slow.read(30)]
        while not isinstance(messages[-1], Aborted):  # the answer to the message written behind it
            messages.append(slow.read(30))
        [answer] = [message for message in messages if isinstance(message, Added)]
        assert answer.request_ids == ["big"]  # refused (too long) once it crossed whole
        assert isinstance(answer.error, ValueError) and "prompt" in str(answer.error), answer.error
    finally:
        for server_end, _ in pipes:
            server_end.close()
        loop.join(30)
    assert not loop.is_alive() and engine.pool.num_used == 0


def test_a_server_that_leaves_a_command_half_written_for_the_stall_timeout_is_detached() -> None:
    """Part of a command is a debt, as an unacknowledged output is: more of it is progress, and a server that
    sends none of the rest for ``stall_timeout`` seconds is detached as stalled; the other stays."""
    now = [0.0]
    pipes = [multiprocessing.Pipe() for _ in range(2)]
    stalled, healthy = (server_end for server_end, _ in pipes)
    reports: list[int] = []
    links = ServerLinks([end for _, end in pipes], stall_timeout=30.0, on_stalled=reports.append, clock=lambda: now[0])
    frame = framed(pickle.dumps([add_command(1, "s0")]))
    write_raw(healthy, frame[:6])
    write_raw(healthy, frame[6:])  # whole within the timeout: no debt left
    assert links.next_command(True) == add_command(1, "s0") and links.silent_since == {}
    write_raw(stalled, frame[:3])  # inside the header
    assert links.next_command(False) is None and links.silent_since == {0: 0.0}
    now[0] = 20.0
    write_raw(stalled, frame[3:-1])
    assert links.next_command(False) is None and links.silent_since == {0: 20.0}
    now[0] = 49.0
    assert links.next_command(False) is None and reports == []
    now[0] = 50.0
    assert links.next_command(False) is None and reports == [0] and links.live == [1]
    message = pickle.loads(stalled.recv_bytes())
    assert isinstance(message, Stopped) and "sent none of the rest of a command it began for 30.0 s" in message.message
    with pytest.raises(EOFError):
        stalled.recv_bytes()


def test_a_server_that_makes_no_progress_for_the_stall_timeout_is_detached() -> None:
    """A server that leaves its outputs unacknowledged (a stopped process, a blocked event loop) held its
    requests, and their slots, until their max_tokens: after ``stall_timeout`` seconds without progress it is
    told why, its requests are aborted, its pipe closed and its supervisor told (``on_stalled``); a server that
    acknowledges within the timeout stays."""
    now = [0.0]
    pipes = [multiprocessing.Pipe() for _ in range(2)]
    stalled, healthy = (server_end for server_end, _ in pipes)
    reports: list[int] = []
    links = ServerLinks([end for _, end in pipes], stall_timeout=30.0, on_stalled=reports.append, clock=lambda: now[0])
    for index, server in enumerate((stalled, healthy)):
        server.send_bytes(pickle.dumps([add_command(1, f"s{index}")]))
        command = links.next_command(True)
        links.post(Added(1, command.request_ids, None, "load"))  # type: ignore[arg-type, union-attr]
    links.post(Stepped([("s0", None, [], False), ("s1", None, [], False)], [], "load"))  # type: ignore[arg-type]
    assert links.silent_since == {0: 0.0, 1: 0.0}  # both owe an acknowledgement
    now[0] = 20.0
    healthy.send_bytes(pickle.dumps([HandledCommand()]))
    links.handled(links.next_command(True))  # type: ignore[arg-type]
    assert links.silent_since == {0: 0.0}  # the healthy one owes nothing more
    now[0] = 29.0
    assert links.next_command(False) is None and reports == []
    links.post(Stepped([("s1", None, [], False)], [], "load"))  # type: ignore[arg-type]
    now[0] = 31.0
    assert links.next_command(False) == AbortCommand(["s0"])  # its requests, aborted by the loop
    assert reports == [0] and links.live == [1] and links.silent_since == {1: 29.0}
    messages = []
    with pytest.raises(EOFError):  # what it was sent, the reason, then its pipe's end
        while True:
            messages.append(pickle.loads(stalled.recv_bytes()))
    assert isinstance(messages[-1], Stopped) and "took none of its outputs for 31.0 s" in messages[-1].message
    now[0] = 58.0  # the healthy server owes an acknowledgement since 29 s ago: within the timeout, it stays
    assert links.next_command(False) is None and links.live == [1]


@pytest.mark.parametrize("max_tokens", [3, 100_000], ids=["idle", "stepping"])
def test_an_engine_loop_detaches_a_stalled_server_whether_it_steps_or_idles(max_tokens: int) -> None:
    """The loop looks for stalled servers while it steps, and while it waits for commands (its wait then ends at
    the timeout): a server that never acknowledges is detached, its requests' slots freed, and a loop left with
    no server ends."""
    engine = make_engine()
    server_end, engine_end = multiprocessing.Pipe()
    links = ServerLinks([engine_end], stall_timeout=0.5)
    core = EngineCore(engine, links.next_command, links.post, links.encoder.row, links, encoder=links.encoder)
    loop = threading.Thread(target=core.run, daemon=True)
    loop.start()
    try:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, output_kind=OutputKind.DELTA)
        server_end.send_bytes(pickle.dumps([AddCommand(0, ["a", "b"], ["The cat", "Hello"], params, 0.0)]))
        loop.join(60)
        assert not loop.is_alive(), "the stalled server was never detached"
    finally:
        server_end.close()
        loop.join(30)
    assert engine.pool.num_used == 0 and not engine.has_unfinished_requests()
