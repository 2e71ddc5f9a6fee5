"""Output kinds: ``DELTA`` and ``FINAL_ONLY`` carry exactly what ``CUMULATIVE`` carries, built only as needed."""

from __future__ import annotations

from collections import defaultdict

from rnnserve.engine.llm import LLM
from rnnserve.engine.outputs import CompletionOutput, RequestOutput
from rnnserve.engine.sampling_params import OutputKind, SamplingParams
from rnnserve.engine.sequence import SequenceGroup
from tests.engine.conftest import make_engine

PROMPTS = ["Once upon", "The cat sat", "x"]
SAMPLED = {"temperature": 0.9, "seed": 7, "max_tokens": 40, "ignore_eos": True, "n": 2, "logprobs": 2}


def run(kind: OutputKind, stop: list[str]) -> dict[str, list[RequestOutput]]:
    """Every output of every request, in order."""
    engine = make_engine()
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(prompt, SamplingParams(**SAMPLED, stop=stop, output_kind=kind), request_id=f"r{i}")
    outputs: dict[str, list[RequestOutput]] = defaultdict(list)
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id].append(out)
    assert engine.pool.num_used == 0
    return outputs


def a_stop_string() -> str:
    """Two characters from the middle of a sample's text, so the stop string is met and cuts the output."""
    text = run(OutputKind.CUMULATIVE, [])["r0"][-1].outputs[0].text
    assert len(text) >= 12, text
    return text[len(text) // 2 : len(text) // 2 + 2]


def logprob_values(entries: list) -> list[tuple]:
    return [(e.token_id, e.logprob, e.top) for e in entries]


def test_delta_and_final_only_carry_what_cumulative_carries() -> None:
    stop = [a_stop_string()]
    cumulative = run(OutputKind.CUMULATIVE, stop)
    delta = run(OutputKind.DELTA, stop)
    final_only = run(OutputKind.FINAL_ONLY, stop)
    assert cumulative.keys() == delta.keys() == final_only.keys() == {f"r{i}" for i in range(len(PROMPTS))}
    assert any(s.finish_reason == "stop" for outs in cumulative.values() for s in outs[-1].outputs)
    for request_id, outs in cumulative.items():
        final = outs[-1]
        assert final.finished and all(not o.finished for o in outs[:-1])
        (only,) = final_only[request_id]  # one output, at the end
        assert only.finished
        assert len(delta[request_id]) == len(outs)
        for index, expected in enumerate(final.outputs):
            got = only.outputs[index]
            assert (got.text, got.token_ids, got.finish_reason) == (expected.text, expected.token_ids,
                                                                    expected.finish_reason)  # fmt: skip
            assert logprob_values(got.logprobs) == logprob_values(expected.logprobs)
            assert got.cumulative_logprob == expected.cumulative_logprob
            assert got.num_tokens == expected.num_tokens == len(expected.token_ids)
            pieces = [out.outputs[index] for out in delta[request_id]]
            for piece in pieces:
                assert piece.text == piece.text_delta and piece.token_ids == piece.new_token_ids
                assert logprob_values(piece.logprobs) == logprob_values(piece.new_logprobs)
            assert "".join(p.text for p in pieces) == expected.text
            assert [t for p in pieces for t in p.token_ids] == expected.token_ids
            assert logprob_values([e for p in pieces for e in p.logprobs]) == logprob_values(expected.logprobs)
            assert pieces[-1].num_tokens == expected.num_tokens
            assert pieces[-1].finish_reason == expected.finish_reason


def test_an_aborted_final_only_request_returns_what_it_had() -> None:
    aborted = {}
    for kind in (OutputKind.CUMULATIVE, OutputKind.FINAL_ONLY):
        engine = make_engine()
        engine.add_request("Once upon", SamplingParams(temperature=0, max_tokens=50, output_kind=kind), "a")
        seen = [out for _ in range(6) for out in engine.step()]  # the prefill step's token, then five more
        assert len(seen) == (6 if kind is OutputKind.CUMULATIVE else 0)
        out = engine.abort_request("a")
        assert out is not None and out.finished and engine.pool.num_used == 0
        aborted[kind] = out.outputs[0]
    cumulative, final_only = aborted[OutputKind.CUMULATIVE], aborted[OutputKind.FINAL_ONLY]
    assert final_only.finish_reason == cumulative.finish_reason == "abort"
    assert len(final_only.token_ids) == 6
    assert (final_only.token_ids, final_only.text) == (cumulative.token_ids, cumulative.text)


def test_steps_report_token_latencies_without_outputs() -> None:
    """Queue time and TTFT once per request, one inter-token gap per later token, whatever the output kind (so
    metrics need no per-step output)."""
    engine = make_engine()
    params = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True, output_kind=OutputKind.FINAL_ONLY)
    for i in range(5):
        engine.add_request(f"prompt {i}", params)
    queue, first, inter = [], [], []
    while engine.has_unfinished_requests():
        engine.step()
        queue += engine.last_step.latencies.queue
        first += engine.last_step.latencies.first_token
        inter += engine.last_step.latencies.all_inter_token()
    assert len(queue) == len(first) == 5 and len(inter) == 5 * 6
    assert all(q >= 0 for q in queue) and all(f >= q for f, q in zip(first, queue, strict=True))
    assert all(gap > 0 for gap in inter)


def test_llm_generate_reads_final_outputs_and_leaves_the_params_alone() -> None:
    llm = LLM("random:mingru-tiny", max_num_seqs=4)
    params = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)
    (out,) = llm.generate([[1, 2, 3]], params)
    assert params.output_kind is OutputKind.CUMULATIVE
    assert out.finished and len(out.outputs[0].token_ids) == 9 == out.outputs[0].num_tokens



def collect_every(kind: OutputKind, every: int) -> tuple[dict[str, list[RequestOutput]], int]:
    """Every output of two requests, the steps collecting every ``every``-th time; ``gone`` is aborted after
    the sixth step (its abort's output last in its list). Returns the outputs and the number of steps."""
    engine = make_engine()
    params = SamplingParams(**SAMPLED, output_kind=kind)
    engine.add_request(PROMPTS[0], params, request_id="r0")
    engine.add_request(PROMPTS[1], params, request_id="gone")
    outputs: dict[str, list[RequestOutput]] = defaultdict(list)
    steps = 0
    while engine.has_unfinished_requests():
        steps += 1
        collected = engine.step(collect=steps % every == 0)
        assert collected == [] or steps % every == 0
        for out in collected:
            outputs[out.request_id].append(out)
        if steps == 6:
            # unfinished FINAL_ONLY requests have nothing to read yet
            assert engine.has_uncollected_outputs == (every > 1 and kind is not OutputKind.FINAL_ONLY)
            aborted = engine.abort_request("gone")
            assert aborted is not None and aborted.finished
            outputs["gone"].append(aborted)
    for out in engine.collect_outputs():
        outputs[out.request_id].append(out)
    assert not engine.has_uncollected_outputs and engine.pool.num_used == 0
    return outputs, steps


def joined(outputs: list[RequestOutput], index: int) -> tuple[str, list[int], list[tuple]]:
    samples = [out.outputs[index] for out in outputs]
    logprobs = [e for s in samples for e in s.logprobs] if samples[0].logprobs is not None else []
    return "".join(s.text for s in samples), [t for s in samples for t in s.token_ids], logprob_values(logprobs)


def whole(sample: CompletionOutput) -> tuple:
    return sample.text, sample.token_ids, logprob_values(sample.logprobs or []), sample.finish_reason, sample.num_tokens


def test_steps_that_do_not_collect_leave_each_requests_progress_to_one_output() -> None:
    """Steps run with ``collect=False`` return nothing; the next collection builds one output per request that
    covers them all (``DELTA``: what they added together; ``CUMULATIVE``: the whole sample; ``FINAL_ONLY``: only
    once finished), and an aborted request's uncollected progress goes with its abort, never twice."""
    for kind in OutputKind:
        each_step, steps = collect_every(kind, 1)
        every_fourth, same_steps = collect_every(kind, 4)
        assert steps == same_steps == SAMPLED["max_tokens"]
        for request_id in ("r0", "gone"):
            ours, theirs = every_fourth[request_id], each_step[request_id]
            if kind is OutputKind.DELTA:
                for index in range(SAMPLED["n"]):
                    assert joined(ours, index) == joined(theirs, index)
                assert max(len(out.outputs[0].new_token_ids) for out in ours) == 4
            else:  # the whole samples (their deltas are what each collection added, so they differ)
                assert [whole(s) for s in ours[-1].outputs] == [whole(s) for s in theirs[-1].outputs]
        if kind is OutputKind.DELTA:
            assert len(every_fourth["r0"]) == steps // 4 and len(each_step["r0"]) == steps
            assert len(every_fourth["gone"]) == 2  # after the fourth step, then the abort's (steps 5 and 6)
        elif kind is OutputKind.FINAL_ONLY:
            assert len(every_fourth["r0"]) == 1 and len(every_fourth["gone"]) == 1


def test_a_collection_leaves_the_requests_it_does_not_want_to_a_later_one() -> None:
    """``collect(build, wanted)`` builds the outputs of the wanted requests only; the others keep their progress,
    finished or not, for the next collection, which builds it as one output (an engine process's API server that
    stalls gets its requests' outputs so, merged, once it handles what it holds)."""
    engine = make_engine()
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, output_kind=OutputKind.DELTA)
    for request_id, prompt in zip(("wanted", "held"), PROMPTS, strict=False):
        engine.add_request(prompt, params, request_id=request_id)
    streamed = []
    while engine.has_unfinished_requests():
        engine.step(collect=False)
        outputs = engine.collect(SequenceGroup.output, lambda group: group.request_id == "wanted")
        assert [out.request_id for out in outputs] == ["wanted"]
        streamed.append(outputs[0])
    assert len(streamed) == 6 and engine.pool.num_used == 0 and engine.has_uncollected_outputs
    (held,) = engine.collect_outputs()
    assert held.request_id == "held" and held.finished and len(held.outputs[0].new_token_ids) == 6
    assert not engine.has_uncollected_outputs
