"""The engine process's compact outputs of streams, sent as columns per API server (``OutputEncoder.take_deltas``)
and decoded back (``OutputDecoder``): each server's outputs are exactly what an engine in the server's own process
builds, step by step, whatever else the step carries, through aborts and a server that leaves.

An engine loop over :class:`ServerLinks` is stepped here by hand (no thread), beside a reference engine over the
same model that gets the same requests, aborts and steps: both step alike, so each request's outputs must match."""

from __future__ import annotations

import dataclasses
import functools
import multiprocessing
import pickle
from multiprocessing.connection import Connection

import pytest

from rnnserve.engine import sequence
from rnnserve.engine.outputs import RequestMetrics, RequestOutput, merge_deltas
from rnnserve.engine.sampling_params import OutputKind, SamplingParams
from rnnserve.engine.sequence import Sequence as Sample
from rnnserve.server import engine_core
from rnnserve.server.engine_core import (
    AbortCommand,
    Aborted,
    AddCommand,
    EncodedStep,
    EngineCore,
    HandledCommand,
    OutputDecoder,
    ServerLinks,
    StopCommand,
)
from tests.server.test_engine_process import lockstep_engines

STREAM = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, output_kind=OutputKind.DELTA)


def stream(max_tokens: int, **fields: object) -> SamplingParams:
    return dataclasses.replace(STREAM, max_tokens=max_tokens, **fields)


def without_times(out: RequestOutput) -> RequestOutput:
    return dataclasses.replace(out, metrics=RequestMetrics(0.0))


class Harness:
    """``num_servers`` API servers' ends of the pipes of an engine loop run step by step, each decoding what it
    reads as a ``ProcessDriver`` does and handling it at once, and the reference engine."""

    def __init__(self, num_servers: int) -> None:
        self.engine, self.reference = lockstep_engines()
        pipes = [multiprocessing.Pipe() for _ in range(num_servers)]
        self.conns: list[Connection] = [server_end for server_end, _ in pipes]
        self.links = ServerLinks([engine_end for _, engine_end in pipes])
        links = self.links
        self.core = EngineCore(self.engine, links.next_command, links.post, links.encoder.row, links,
                               encoder=links.encoder)  # fmt: skip
        self.decoders = [OutputDecoder() for _ in pipes]
        self.outputs: dict[str, list[RequestOutput]] = {}  # request id -> what its server decoded
        self.expected: dict[str, list[RequestOutput]] = {}  # ... what the reference engine built
        self.receivers: dict[str, set[int]] = {}  # request id -> the servers that got its outputs
        self.steps: list[list[EncodedStep | None]] = []  # per step, what each server read (None: no outputs)
        self.holding: dict[int, int] = {}  # servers that do not say yet that they handled what they read: how much

    def add(self, server: int, request_id: str, prompt: str, params: SamplingParams) -> None:
        self.conns[server].send_bytes(pickle.dumps([AddCommand(0, [request_id], [prompt], params, 0.0)]))
        # read at once, so that both engines order their batches alike: a row's place moves its logprobs' last bits
        assert self.core._run_commands(False)
        self.reference.add_request(prompt, params, request_id)

    def abort(self, server: int, request_id: str) -> None:
        self.conns[server].send_bytes(pickle.dumps([AbortCommand([request_id])]))
        self.reference.abort_request(request_id)

    def step(self) -> None:
        """Run the commands sent, one step of each engine, and each server's reading of its messages."""
        assert self.core._run_commands(False)
        self.core._step()
        for out in self.reference.step():
            self.expected.setdefault(out.request_id, []).append(out)
        read: list[EncodedStep | None] = []
        for index, conn in enumerate(self.conns):
            read.append(None)
            while not conn.closed and conn.poll(0):
                message = pickle.loads(conn.recv_bytes())
                if isinstance(message, Aborted):
                    self.decoders[index].forget([out.request_id for out in message.finals])
                if not isinstance(message, EncodedStep):
                    continue
                read[-1] = message
                for out in self.decoders[index].decode_step(message):
                    self.outputs.setdefault(out.request_id, []).append(out)
                    self.receivers.setdefault(out.request_id, set()).add(index)
                if index in self.holding:
                    self.holding[index] += 1
                else:
                    conn.send_bytes(pickle.dumps([HandledCommand()]))
        self.steps.append(read)

    def release(self, server: int) -> None:
        """The server handled what it held (:attr:`holding`)."""
        self.conns[server].send_bytes(pickle.dumps([HandledCommand()] * self.holding.pop(server)))

    def run(self) -> None:
        while self.engine.has_unfinished_requests() or self.reference.has_unfinished_requests():
            self.step()

    def check(self, owners: dict[str, int]) -> None:
        """Each request's outputs are the reference's and went to its own server only; nothing is left kept."""
        assert {rid: [without_times(o) for o in outs] for rid, outs in self.outputs.items()} == {
            rid: [without_times(o) for o in outs] for rid, outs in self.expected.items()
        }
        assert self.receivers == {request_id: {owner} for request_id, owner in owners.items()}
        assert not self.links.encoder.compact and not self.links.encoder.sent
        for decoder in self.decoders:
            assert not decoder.known and not decoder.streams

    def compact_outputs(self, server: int) -> int:
        return sum(len(read[server].deltas) // 3 for read in self.steps if read[server] is not None)


def test_the_streams_of_several_servers_interleaved_reach_each_its_own_server_intact() -> None:
    """Three servers whose requests the engine steps together, interleaved: streams (some holding text back for a
    stop string), and beside them requests whose outputs stay full rows (n > 1, logprobs, cumulative, final only)."""
    harness = Harness(3)
    owners = {}
    requests = [
        ("s0-a", "The cat", stream(9)), ("s1-a", "Hello", stream(7)), ("s2-a", "abc", stream(8, stop=["e "])),
        ("s0-b", "Hi", stream(6, n=2, temperature=1.0, seed=3)), ("s1-b", "Hey", stream(5, logprobs=1)),
        ("s2-b", "x", stream(6, output_kind=OutputKind.CUMULATIVE)),
        ("s0-c", "y", stream(4, output_kind=OutputKind.FINAL_ONLY)),
        ("s1-c", "zz", stream(10)), ("s2-c", "Once", stream(3)),
    ]  # fmt: skip
    for request_id, prompt, params in requests:
        owners[request_id] = server = int(request_id[1])
        harness.add(server, request_id, prompt, params)
    harness.run()
    harness.check(owners)
    assert all(harness.compact_outputs(server) > 0 for server in range(3))


def test_a_streams_last_output_in_the_same_step_as_others_compact_ones_ends_it() -> None:
    """A stream that ends while others go on: its last output, a full row, crosses in the message whose columns
    carry the others' compact outputs of that step, and the decoder forgets it."""
    harness = Harness(1)
    owners = {"short": 0, "long": 0, "other": 0}
    harness.add(0, "short", "The cat", stream(3))
    harness.add(0, "long", "Hello", stream(7))
    harness.add(0, "other", "abc", stream(6))
    harness.run()
    harness.check(owners)
    ends = [read[0] for read in harness.steps if read[0] is not None and any(row[0] == "short" for row in read[0].rows)]
    last = ends[-1]
    assert [row[3] for row in last.rows] == [True] and len(last.deltas) == 2 * 3  # long's and other's, compact
    assert harness.outputs["short"][-1].finished and harness.outputs["short"][-1].outputs[0].num_tokens == 3


def test_a_stream_aborted_between_steps_sends_nothing_more_and_its_id_starts_afresh() -> None:
    """A stream aborted by its server between two steps, its id then reused by a new request: the new one's first
    output is a full row with its prompt (the encoder forgot the old one's handle), and the other streams go on."""
    harness = Harness(2)
    harness.add(0, "a", "The cat", stream(20))
    harness.add(1, "b", "Hello", stream(9))
    for _ in range(4):
        harness.step()
    assert harness.compact_outputs(0) > 0
    harness.abort(0, "a")
    harness.step()
    harness.add(0, "a", "Another prompt", stream(5))
    harness.run()
    outputs = harness.outputs["a"]
    first_again = next(i for i, out in enumerate(outputs) if out.prompt == "Another prompt")
    assert sum(len(out.outputs[0].new_token_ids) for out in outputs[first_again:]) == 5
    assert not any(out.finished for out in outputs[:first_again])  # aborted: its end was the Aborted event
    harness.check({"a": 0, "b": 1})


def test_a_server_that_leaves_mid_stream_takes_its_columns_with_it() -> None:
    """A server that stops while its streams run: they are aborted, their compact outputs go to no other server,
    and the other server's streams go on intact."""
    harness = Harness(2)
    harness.add(0, "stays", "The cat", stream(12))
    harness.add(1, "goes", "Hello", stream(12))
    harness.add(1, "goes too", "abc", stream(12))
    for _ in range(4):
        harness.step()
    assert harness.compact_outputs(1) > 0
    harness.conns[1].send_bytes(pickle.dumps([StopCommand()]))
    harness.reference.abort_request("goes")
    harness.reference.abort_request("goes too")
    harness.step()
    assert harness.links.live == [0]
    harness.conns[1].close()
    harness.decoders[1] = OutputDecoder()  # it is gone, with what it kept
    harness.run()
    harness.check({"stays": 0, "goes": 1, "goes too": 1})


def test_a_steady_batch_of_streams_is_taken_in_one_pass_per_server_with_the_same_outputs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Streams of two servers that step together (one holding text back for a stop string) are taken in one pass
    per server (``StreamPlan``) while the same requests progress step after step; a stream that ends, one aborted
    and one that joins send the take back to the per-request path, and it resumes: every output is the reference's."""
    passes = 0
    take = engine_core.StreamPlan.take

    def counted(plan: engine_core.StreamPlan, columns: dict, wanted: object = None) -> list:
        nonlocal passes
        passes += 1
        return take(plan, columns, wanted)

    monkeypatch.setattr(engine_core.StreamPlan, "take", counted)
    harness = Harness(2)
    owners = {"s0-a": 0, "s1-a": 1, "s0-b": 0, "s1-b": 1, "s1-c": 1}
    harness.add(0, "s0-a", "The cat", stream(30))
    harness.add(1, "s1-a", "Hello", stream(24))
    harness.add(0, "s0-b", "abc", stream(30, stop=["e "]))
    harness.add(1, "s1-b", "Hi", stream(12))
    for _ in range(8):
        harness.step()
    before_abort = passes
    assert before_abort >= 4
    harness.abort(0, "s0-a")
    for _ in range(3):
        harness.step()
    harness.add(1, "s1-c", "Once", stream(10))
    harness.run()
    harness.check(owners)
    assert passes > before_abort + 8


def test_a_steady_batch_of_streams_crosses_as_blocks_of_its_kept_steps_per_server() -> None:
    """A steady batch of streams of two servers sends each server one block of its streams' deltas per message (their
    handles, then each kept step's tokens and texts, as the batch kept them): one step while the servers keep up,
    several once they handled nothing for a while; they decode to the reference's outputs (the held steps' merged),
    through an abort."""
    harness = Harness(2)
    owners = {"a": 0, "b": 1, "c": 0, "d": 1, "e": 1}
    for request_id, owner in owners.items():
        harness.add(owner, request_id, "The cat sat", stream(40))
    for _ in range(8):
        harness.step()
    harness.holding = {0: 0, 1: 0}  # both handle nothing for a few steps: the batch's steps are kept meanwhile
    for _ in range(6):
        harness.step()
    harness.release(0)
    harness.release(1)
    for _ in range(4):
        harness.step()
    harness.abort(0, "c")
    harness.run()
    merged = {rid: [without_times(functools.reduce(merge_deltas, outs))] for rid, outs in harness.outputs.items()}
    assert merged == {rid: [without_times(functools.reduce(merge_deltas, outs))]
                      for rid, outs in harness.expected.items()}  # fmt: skip
    harness.outputs, harness.expected = merged, merged  # the servers got several steps' outputs at once
    harness.check(owners)
    blocks: dict[int, list[tuple[int, int]]] = {0: [], 1: []}  # per server: each block's streams and steps
    for read in harness.steps:
        for server, message in enumerate(read):
            if message is not None and message.deltas and isinstance(message.deltas[0], list):
                handles, token_steps, text_steps = message.deltas
                assert len(token_steps) == len(text_steps) and all(len(s) == len(handles) for s in token_steps)
                blocks[server].append((len(handles), len(token_steps)))
    assert {size for size, _ in blocks[0]} == {2, 1} and {size for size, _ in blocks[1]} == {3}  # 1: after the abort
    assert all(min(steps for _, steps in blocks[server]) == 1 for server in blocks)
    assert all(max(steps for _, steps in blocks[server]) > 2 for server in blocks)


@pytest.mark.parametrize("max_kept_steps", [sequence.MAX_KEPT_STEPS, 4])
def test_a_server_behind_leaves_the_other_servers_streams_as_blocks(
    max_kept_steps: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While one server holds what it read (its window full), the other server's streams of the steady batch still
    cross as blocks of the batch's kept steps, none taken stream by stream; the server behind gets its streams'
    held steps as one block once it catches up (or, when the batch settled meanwhile because it kept its most
    steps, each stream's delta), and, behind again when a stream of the batch ends, as deltas after the batch
    settled: every output is the reference's, the held steps' merged."""
    monkeypatch.setattr(sequence, "MAX_KEPT_STEPS", max_kept_steps)
    per_stream = 0  # samples of the engine loop's engine (not the reference's) whose deltas were taken one by one
    in_loop = False

    def counted_stream_deltas(seqs: list, handles: list, column: list) -> None:
        nonlocal per_stream
        per_stream += len(seqs)
        take_stream_deltas(seqs, handles, column)

    def counted_take_delta(seq: Sample) -> tuple:
        nonlocal per_stream
        per_stream += in_loop
        return take_delta(seq)

    take_stream_deltas, take_delta = engine_core.take_stream_deltas, Sample.take_delta
    monkeypatch.setattr(engine_core, "take_stream_deltas", counted_stream_deltas)
    monkeypatch.setattr(Sample, "take_delta", counted_take_delta)
    harness = Harness(2)
    loop_step = harness.core._step

    def counted_step() -> bool:
        nonlocal in_loop
        in_loop = True
        try:
            return loop_step()
        finally:
            in_loop = False

    harness.core._step = counted_step  # type: ignore[method-assign]
    owners = {"a": 0, "b": 1, "c": 0, "d": 1, "short": 0}
    for request_id, owner in owners.items():
        harness.add(owner, request_id, "The cat sat", stream(24 if request_id == "short" else 40))
    for _ in range(8):
        harness.step()
    harness.holding = {1: 0}
    first_held = len(harness.steps)
    held_from = per_stream
    for _ in range(8):
        harness.step()
    assert per_stream == held_from  # without the parts: server 0's streams one by one each step, and the batch settled
    kept_blocks = [read[0].deltas for read in harness.steps[first_held:]]
    assert all(isinstance(deltas[0], list) and len(deltas[1]) == 1 for deltas in kept_blocks)  # a step each
    assert [read[1] is not None for read in harness.steps[first_held:]] == [True, True] + [False] * 6  # full window
    harness.release(1)
    harness.step()
    caught_up = harness.steps[-1][1].deltas
    if max_kept_steps > 8:
        handles, token_steps, _ = caught_up
        assert len(handles) == 2 and len(token_steps) == 7  # the six steps it missed and this one, one block
        assert per_stream == held_from
    else:
        assert [type(entry) for entry in caught_up[::3]] == [int, int]  # settled: its streams' deltas
        assert per_stream == held_from + 2
        assert harness.steps[-1][0].deltas[0].__class__ is list  # server 0's streams still a block
    harness.holding = {1: 0}
    for _ in range(12):  # "short" ends meanwhile: the batch settles with server 1's steps not taken
        harness.step()
    harness.release(1)
    harness.run()
    merged = {rid: [without_times(functools.reduce(merge_deltas, outs))] for rid, outs in harness.outputs.items()}
    assert merged == {rid: [without_times(functools.reduce(merge_deltas, outs))]
                      for rid, outs in harness.expected.items()}  # fmt: skip
    harness.outputs, harness.expected = merged, merged
    harness.check(owners)
