"""A steady batch's tokens are appended for the whole batch (``SteadyAppend``) while none of them ends a sample: the
engine must give the same tokens, texts, finish reasons, outputs, metrics and step latencies as appending them one
by one, through ends by a stop token and by ``max_tokens``, aborts between steps, arrivals mid-batch, stop strings,
logprobs, ``n > 1``, every output kind and seeded sampling, with async scheduling off and on."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable

import pytest
import torch

from rnnserve.engine import llm_engine, scheduler, sequence
from rnnserve.engine.llm_engine import LLMEngine
from rnnserve.engine.outputs import RequestOutput
from rnnserve.engine.sampling_params import OutputKind, SamplingParams
from rnnserve.server.engine_core import OutputDecoder, OutputEncoder
from tests.engine.conftest import make_engine

MODES = ["off", "on"]


class FakeClock:
    """Every clock the engine reads, ticking by one per read from :meth:`reset`: two runs that read it alike see
    the same times."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._ticks = itertools.count(1.0)

    def monotonic(self) -> float:
        return next(self._ticks)

    perf_counter = monotonic


@pytest.fixture
def fake_clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    clock = FakeClock()
    for module in (llm_engine, scheduler, sequence):
        monkeypatch.setattr(module, "time", clock)
    return clock


def step_record(engine: LLMEngine, outputs: list[RequestOutput]) -> tuple:
    """What a step gave its callers: each output's fields (a final state's tokens, consumed and pending), and the
    step's token count and latencies."""
    stats = engine.last_step
    latencies = stats.latencies
    return (
        [(o.request_id, o.finished, o.error, o.metrics, [
            (c.index, c.text, c.token_ids, c.finish_reason, c.logprobs, c.cumulative_logprob, c.text_delta,
             c.new_token_ids, c.new_logprobs, c.num_tokens, c.stop_reason) for c in o.outputs
        ], (o.final_state.token_ids, o.final_state.pending_token_ids) if o.final_state is not None else None)
         for o in outputs],
        stats.generated_tokens, stats.decode_batch_size, latencies.queue, latencies.first_token,
        latencies.all_inter_token(), latencies.started,
    )  # fmt: skip


def run_script(
    async_scheduling: str,
    script: dict[int, list],
    steady: bool,
    clock: FakeClock,
    model: Callable[[LLMEngine], None] | None = None,
    encoded: bool = False,
) -> tuple[list[tuple], int]:
    """Run ``script`` (step -> ``("add", request_id, prompt, params[, add_request's keywords])`` / ``("abort",
    request_id)`` actions) until
    every request ended; returns each step's record and how many steps the steady append took (with ``steady``
    false it never starts, nor does the runner's decode of a steady batch: each decode builds its inputs and counts
    each sample's fed token). ``model`` changes the engine's model first. ``encoded``: the outputs are collected as
    the engine process does (``OutputEncoder``'s rows and stream columns, decoded by an ``OutputDecoder``), and
    every third step is left to the next collection (two steps' outputs taken at once)."""
    clock.reset()
    engine = make_engine(max_num_seqs=8, max_num_batched_tokens=64, async_scheduling=async_scheduling)
    if model is not None:
        model(engine)
    if not steady:
        decode = engine.runner.decode

        def decode_anew(*args):  # type: ignore[no-untyped-def]
            logits = decode(*args)
            engine.runner._decoding = None  # the next decode is not the same batch's
            return logits

        engine.runner.decode = decode_anew  # type: ignore[method-assign]
    fast_steps = 0
    appended = engine.scheduler._steady_appended

    def counted(*args):  # type: ignore[no-untyped-def]
        nonlocal fast_steps
        fast_steps += 1
        return appended(*args)

    engine.scheduler._steady_appended = counted  # type: ignore[method-assign]
    if not steady:
        engine.scheduler._start_steady_append = lambda seqs, now: None  # type: ignore[method-assign]
    encoder, decoder = OutputEncoder(), OutputDecoder()

    def step_outputs(step: int) -> list[RequestOutput]:
        if not encoded:
            return engine.step()
        engine.step(collect=False)
        if step % 3 == 1 and engine.has_unfinished_requests():
            return []
        rows = engine.collect(encoder.row, None, encoder.take_deltas)
        return decoder.decode(rows, encoder.take_columns().get(None, []))

    records = []
    for step in range(1000):
        for action in script.get(step, []):
            if action[0] == "add":
                engine.add_request(action[2], action[3], action[1], **(action[4] if len(action) > 4 else {}))
            else:
                aborted = engine.abort_request(action[1])
                encoder.forget([action[1]])
                decoder.forget([action[1]])
                records.append(step_record(engine, [aborted] if aborted is not None else []))
        if step > max(script) and not engine.has_unfinished_requests():
            return records, fast_steps
        records.append(step_record(engine, step_outputs(step)))
        check_pending(engine)
    raise AssertionError("the engine did not finish")


def check_pending(engine: LLMEngine) -> None:
    """Between steps, a sample counts as pending exactly the token of the step in flight that has it, if any (the
    scheduler reads it to stop at ``max_tokens``)."""
    in_flight = {id(s) for s in engine._in_flight.seqs} if engine._in_flight is not None else set()
    for group in engine.scheduler.running.values():
        for seq in group.seqs:
            assert seq.num_pending == (id(seq) in in_flight), (group.request_id, seq.num_pending)


def reference_tokens(prompt: list[int], max_tokens: int) -> list[int]:
    """The greedy tokens the test model gives ``prompt`` on its own."""
    engine = make_engine()
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), "ref")
    for _ in range(max_tokens + 10):
        for out in engine.step():
            if out.finished:
                return out.outputs[0].token_ids
    raise AssertionError("no output")


@pytest.mark.parametrize("async_scheduling", MODES)
def test_a_steady_batch_where_samples_end_leave_and_join(async_scheduling: str, fake_clock: FakeClock) -> None:
    """One sample stops at a stop token, one at ``max_tokens``, one is aborted between steps and one joins
    while the others decode; streams and final outputs alike."""
    stopping = [1, 2, 3, 4, 5]
    tokens = reference_tokens(stopping, 40)
    stop_at = next(i for i in range(12, 40) if tokens[i] not in tokens[:i])  # its first appearance, late enough
    stream, final = OutputKind.DELTA, OutputKind.FINAL_ONLY
    script = {
        0: [
            ("add", "stop", stopping, SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[tokens[stop_at]],
                                                     output_kind=stream)),
            ("add", "length", [9, 8, 7], SamplingParams(temperature=0, max_tokens=18, ignore_eos=True,
                                                        output_kind=final)),
            ("add", "aborted", [40, 41], SamplingParams(temperature=0, max_tokens=60, ignore_eos=True,
                                                        output_kind=stream)),
            ("add", "long", [70, 71, 72], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True,
                                                         output_kind=final)),
        ],
        9: [("abort", "aborted")],
        14: [("add", "joins", [100, 101], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, n=2,
                                                         output_kind=stream))],
    }  # fmt: skip
    general, none_fast = run_script(async_scheduling, script, False, fake_clock)
    fast, fast_steps = run_script(async_scheduling, script, True, fake_clock)
    assert none_fast == 0
    assert fast_steps > 20  # most steps of the run took the steady append
    assert fast == general
    finals = {o[0]: o for record in fast for o in record[0] if o[1]}
    assert {rid: o[4][0][3] for rid, o in finals.items()} == {
        "stop": "stop", "length": "length", "aborted": "abort", "long": "length", "joins": "length"
    }  # fmt: skip
    assert finals["stop"][4][0][10] == tokens[stop_at]


@pytest.mark.parametrize("async_scheduling", MODES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_churning_workload_gives_the_same_as_appending_one_by_one(
    async_scheduling: str, seed: int, fake_clock: FakeClock
) -> None:
    rng = random.Random(seed)
    script: dict[int, list] = {}
    live: list[str] = []
    bursts = rng.sample(range(80), 4)  # arrivals in bursts, steady batches between them
    for index in range(16):
        step = rng.choice(bursts)
        kind = rng.choice([OutputKind.DELTA, OutputKind.FINAL_ONLY, OutputKind.CUMULATIVE])
        params = SamplingParams(
            temperature=rng.choice([0.0, 0.0, 0.8]),
            seed=rng.randrange(1000),
            max_tokens=rng.randint(1, 80),
            n=rng.choice([1, 1, 2]),
            stop_token_ids=rng.sample(range(256), 4) if rng.random() < 0.5 else [],
            stop=["e", "xy"] if rng.random() < 0.1 else [],
            logprobs=2 if rng.random() < 0.1 else None,
            ignore_eos=rng.random() < 0.5,
            output_kind=kind,
        )
        request_id = f"r{index}"
        live.append(request_id)
        script.setdefault(step, []).append(("add", request_id, [rng.randrange(256) for _ in range(8)], params))
    for step in rng.sample(range(10, 100), 3):
        script.setdefault(step, []).append(("abort", rng.choice(live)))
    general, _ = run_script(async_scheduling, script, False, fake_clock)
    fast, fast_steps = run_script(async_scheduling, script, True, fake_clock)
    assert fast_steps > 0
    assert fast == general


def test_the_steady_append_leaves_a_step_with_an_end_token_or_a_limit_to_each_sample() -> None:
    """A step whose tokens include one that ends some sample, or that takes a sample to its ``max_tokens``, is
    not appended for the batch (nothing changes), and the next steps are not either once a sample is at its
    limit."""
    engine = make_engine(max_num_seqs=4)
    params = SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[7])
    for index in range(3):
        engine.add_request([1, 2, 3], params, f"r{index}")
    engine.step()
    seqs = [s for g in engine.scheduler.running.values() for s in g.seqs]
    steady = sequence.SteadyAppend(seqs)
    before = [list(s.output_token_ids) for s in seqs]
    texts = [s.text for s in seqs]
    assert steady.end_ids >= {7, engine.eos_token_id}
    assert not steady.append([65, 7, 66])
    assert [s.output_token_ids for s in seqs] == before
    room = steady.room
    for _ in range(room - 1):
        assert steady.append([65, 66, 67])
    assert not steady.append([65, 66, 67])
    assert [len(s.output_token_ids) for s in seqs] == [s.max_tokens - 1 for s in seqs]
    assert [s.text for s in seqs] == [text + letter * (room - 1) for text, letter in zip(texts, "ABC", strict=True)]


@pytest.mark.parametrize("async_scheduling", MODES)
def test_collect_takes_a_steady_batchs_requests_as_they_are_and_still_gets_their_ends(async_scheduling: str) -> None:
    """Outputs collected every other step: while only steady steps (nothing ended) ran since the last collection,
    the engine takes their requests without checking each; a step where samples end is collected the usual way,
    so every stream's deltas add up to its tokens and each ends once."""
    engine = make_engine(max_num_seqs=4, async_scheduling=async_scheduling)
    for index, max_tokens in enumerate([9, 14, 14]):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, output_kind=OutputKind.DELTA)
        engine.add_request([1, 2, 3 + index], params, f"r{index}")
    tokens: dict[str, list[int]] = {}
    ends: list[str] = []
    as_they_are = 0
    for step in itertools.count():
        if not engine.has_unfinished_requests():
            break
        engine.step(collect=False)
        if step % 2:
            as_they_are += engine._uncollected_ongoing and engine.has_uncollected_outputs
            for out in engine.collect_outputs():
                tokens.setdefault(out.request_id, []).extend(out.outputs[0].new_token_ids)
                ends += [out.request_id] * out.finished
    for out in engine.collect_outputs():
        tokens.setdefault(out.request_id, []).extend(out.outputs[0].new_token_ids)
        ends += [out.request_id] * out.finished
    assert as_they_are >= 2
    assert sorted(ends) == ["r0", "r1", "r2"]
    assert {rid: len(ids) for rid, ids in tokens.items()} == {"r0": 9, "r1": 14, "r2": 14}
    assert tokens["r0"] == reference_tokens([1, 2, 3], 9)


TEXT_BYTES = list("añb€c✓ ".encode())  # characters of one, two and three bytes
EOS_POSITION = 40  # where the model gives EOS (the requests that ignore it go on)


def utf8_model(engine: LLMEngine) -> None:
    """Make the engine's model write multi-byte UTF-8 text: the token at position ``p`` is ``TEXT_BYTES[p % 9]``
    (after a prompt, and in a decode when the token fed at ``p - 1`` is the text's too, else ``X``), EOS at
    :data:`EOS_POSITION` (the model's states are computed as before)."""
    model, runner = engine.runner.model, engine.runner
    decode, prefill = model.decode, runner.prefill
    text = torch.tensor(TEXT_BYTES)

    def text_prefill(chunks):  # type: ignore[no-untyped-def]
        logits = prefill(chunks)
        with torch.inference_mode():
            for chunk, rows in zip(chunks, logits, strict=True):
                rows[-1] = -10.0
                rows[-1, TEXT_BYTES[chunk.end % len(TEXT_BYTES)]] = 10.0
        return logits

    def text_decode(batch, state):  # type: ignore[no-untyped-def]
        logits = decode(batch, state)
        following = batch.positions + 1
        fed_text = batch.input_ids == text[batch.positions % len(TEXT_BYTES)]
        tokens = torch.where(fed_text, text[following % len(TEXT_BYTES)], ord("X"))
        tokens = torch.where(following == EOS_POSITION, engine.eos_token_id, tokens)
        chosen = torch.full_like(logits, -10.0)
        chosen[torch.arange(len(tokens)), tokens] = 10.0
        return chosen

    model.decode = text_decode
    runner.prefill = text_prefill


def opening_adds(eos: OutputKind, length: OutputKind, aborted: OutputKind, long: OutputKind) -> list[tuple]:
    """The four requests a scripted run starts with, of the output kinds given: one that ends at EOS and one at
    ``max_tokens`` (both returning their final states), one for the script to abort, and a long one (final state)."""
    greedy = {"temperature": 0}
    return [
        ("add", "eos", [1, 2, 3], SamplingParams(**greedy, max_tokens=60, output_kind=eos), {"return_state": True}),
        ("add", "length", [9, 8, 7, 6], SamplingParams(**greedy, max_tokens=25, ignore_eos=True, output_kind=length),
         {"return_state": True}),
        ("add", "aborted", [40, 41], SamplingParams(**greedy, max_tokens=60, ignore_eos=True, output_kind=aborted)),
        ("add", "long", [70, 71, 72], SamplingParams(**greedy, max_tokens=70, ignore_eos=True, output_kind=long),
         {"return_state": True}),
    ]


@pytest.mark.parametrize("async_scheduling", MODES)
def test_a_steady_batch_per_batch_bookkeeping_gives_the_general_paths_outputs(
    async_scheduling: str, fake_clock: FakeClock
) -> None:
    """What a steady batch keeps per batch (its requests' token times, the tokens its decodes fed, its latest
    sampled tokens as its next decode's input) gives each request what the general path gives: a sample that ends
    at EOS, one at ``max_tokens``, one aborted between steps, one that joins mid-batch with ``n`` = 2, one with a
    stop string, over multi-byte UTF-8 text; the final states (from ``num_fed``) and metrics alike."""
    stream, final = OutputKind.DELTA, OutputKind.FINAL_ONLY
    script = {
        0: opening_adds(final, stream, stream, final),
        9: [("abort", "aborted")],
        14: [("add", "joins", [100, 101], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, n=2,
                                                         output_kind=stream))],
        45: [("add", "stop", [5, 6], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=["€c"],
                                                    output_kind=stream))],
    }  # fmt: skip
    general, none_fast = run_script(async_scheduling, script, False, fake_clock, utf8_model)
    fast, fast_steps = run_script(async_scheduling, script, True, fake_clock, utf8_model)
    assert none_fast == 0
    assert fast_steps > 30
    assert fast == general
    finals = {o[0]: o for record in fast for o in record[0] if o[1]}
    assert {rid: o[4][0][3] for rid, o in finals.items()} == {
        "eos": "stop", "length": "length", "aborted": "abort", "long": "length", "joins": "length", "stop": "stop"
    }  # fmt: skip
    assert "€" in finals["long"][4][0][1] and "✓" in finals["long"][4][0][1]
    assert finals["stop"][4][0][10] == "€c"
    assert len(finals["eos"][4][0][2]) == EOS_POSITION - 2  # positions 3 (after the prompt) to EOS's
    consumed, pending = finals["long"][5]
    assert len(consumed) + len(pending) == 3 + 70


@pytest.mark.parametrize("async_scheduling", MODES)
def test_a_final_only_batch_keeps_its_tokens_for_the_batch_until_they_are_read(
    async_scheduling: str, fake_clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A steady batch of ``FINAL_ONLY`` samples keeps each step's tokens for the whole batch (``SteadyAppend.steps``)
    and puts them into the samples' lists when one is read: whatever reads them (the sampler's ``min_tokens`` check
    of a sample that has one, the final state of a sample that returns it, an abort's output, the scheduler's pass
    over the samples, a sample's end) gets what the general path gives, as do the outputs and metrics."""
    final = OutputKind.FINAL_ONLY
    script = {
        0: opening_adds(final, final, final, final),
        12: [("abort", "aborted")],
        # min_tokens past EOS's position: the sampler reads its token count every step (EOS is banned there)
        30: [("add", "joins", [100, 101], SamplingParams(temperature=0, max_tokens=50, min_tokens=45, n=2,
                                                         output_kind=final))],
    }  # fmt: skip
    kept: list[int] = []  # how many steps each settling of a batch put into its samples' lists
    settle = sequence.SteadyAppend.settle

    def counted_settle(self):  # type: ignore[no-untyped-def]
        kept.append(len(self.steps))
        settle(self)

    monkeypatch.setattr(sequence.SteadyAppend, "settle", counted_settle)
    general, none_fast = run_script(async_scheduling, script, False, fake_clock, utf8_model)
    assert none_fast == 0 and not any(kept)
    fast, fast_steps = run_script(async_scheduling, script, True, fake_clock, utf8_model)
    assert fast_steps > 40
    assert max(kept) > 5  # steps kept for the batch, then read at once
    assert fast == general
    finals = {o[0]: o for record in fast for o in record[0] if o[1]}
    assert {rid: o[4][0][3] for rid, o in finals.items()} == {
        "eos": "stop", "length": "length", "aborted": "abort", "long": "length", "joins": "length"
    }  # fmt: skip
    assert len(finals["aborted"][4][0][2]) > 8
    assert [len(c[2]) for c in finals["joins"][4]] == [50, 50] and "X" in finals["joins"][4][0][1]
    consumed, pending = finals["long"][5]
    assert len(consumed) + len(pending) == 3 + 70


@pytest.mark.parametrize("encoded", [False, True])
@pytest.mark.parametrize("async_scheduling", MODES)
def test_a_batch_of_streams_keeps_its_steps_texts_for_the_batch(
    async_scheduling: str, encoded: bool, fake_clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A steady batch of streams keeps each step's tokens and texts (what each sample's decoder gave, multi-byte
    characters included) for the whole batch; the engine process's stream plan takes the kept steps as the streams'
    deltas (one step, or two when a collection was skipped), and whatever reads a sample (an output's row, the
    ``min_tokens`` check, a final state, an abort, an end) settles them first: every output is the general path's."""
    stream = OutputKind.DELTA
    script = {
        0: opening_adds(stream, stream, stream, stream),
        10: [("abort", "aborted")],
        44: [("add", "cumulative", [5, 6], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                          output_kind=OutputKind.CUMULATIVE))],
        # min_tokens past EOS's position (40): the sampler reads its token count every step
        56: [("add", "min", [100] * 30, SamplingParams(temperature=0, max_tokens=20, min_tokens=15,
                                                       output_kind=stream))],
    }  # fmt: skip
    kept: list[int] = []  # how many kept steps each take of the stream plan took
    take_kept = sequence.SteadyAppend.take_kept

    def counted_take(self, part=0):  # type: ignore[no-untyped-def]
        kept.append(len(self.steps) - self.taken[part])
        return take_kept(self, part)

    monkeypatch.setattr(sequence.SteadyAppend, "take_kept", counted_take)
    general, none_fast = run_script(async_scheduling, script, False, fake_clock, utf8_model, encoded)
    assert none_fast == 0 and not kept
    fast, fast_steps = run_script(async_scheduling, script, True, fake_clock, utf8_model, encoded)
    assert fast_steps > 40
    if encoded:  # the plan took kept steps, one and two at a time
        assert {1, 2} <= set(kept)
    assert fast == general
    finals = {o[0]: o for record in fast for o in record[0] if o[1]}
    assert {rid: o[4][0][3] for rid, o in finals.items()} == {
        "eos": "stop", "length": "length", "aborted": "abort", "long": "length", "cumulative": "length",
        "min": "length",
    }  # fmt: skip
    texts = {}
    for record in fast:
        for output in record[0]:
            texts[output[0]] = texts.get(output[0], "") + output[4][0][6]
    assert "€" in texts["long"] and "✓" in texts["long"] and len(texts["long"]) < 70
    consumed, pending = finals["long"][5]
    assert len(consumed) + len(pending) == 3 + 70
