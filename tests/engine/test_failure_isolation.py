"""A failure while processing one request fails that request alone; the others finish as if it never ran (with
the synchronous engine and with async scheduling, where a step's tokens are read while the next step runs)."""

from __future__ import annotations

import dataclasses

import pytest

from rnnserve.engine import llm_engine
from rnnserve.engine.llm_engine import LLMEngine
from rnnserve.engine.sampling_params import OutputKind, SamplingParams
from rnnserve.engine.sequence import Sequence
from rnnserve.engine.tokenizer import Utf8StreamDecoder
from tests.engine.conftest import make_engine, run_to_completion

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
SCHEDULING = pytest.mark.parametrize("scheduling", ["off", "on"])


def reference(prompts: list[str]) -> dict[str, list[int]]:
    engine = make_engine()
    ids = [engine.add_request(p, GREEDY, request_id=p) for p in prompts]
    final = run_to_completion(engine)
    return {i: final[i].outputs[0].token_ids for i in ids}


def run_with_victim(engine: LLMEngine, prompts: list[str]) -> dict:
    for p in prompts:
        engine.add_request(p, GREEDY, request_id=p)
    final = run_to_completion(engine)
    assert engine.pool.num_used == 0 and not engine.has_unfinished_requests()
    return final


@SCHEDULING
def test_sampling_error_fails_only_its_request(monkeypatch: pytest.MonkeyPatch, scheduling: str) -> None:
    prompts = ["alpha", "victim", "gamma"]
    expected = reference(prompts)
    real_sample = llm_engine.sample

    def sample(logits, seqs: list[Sequence]):  # type: ignore[no-untyped-def]
        if any(s.group.request_id == "victim" and len(s.output_token_ids) == 3 for s in seqs):
            raise OverflowError("cannot convert float infinity to integer")
        return real_sample(logits, seqs)

    monkeypatch.setattr(llm_engine, "sample", sample)
    final = run_with_victim(make_engine(async_scheduling=scheduling), prompts)
    assert final["victim"].error == "OverflowError: cannot convert float infinity to integer"
    assert final["victim"].outputs[0].finish_reason == "error"
    assert len(final["victim"].outputs[0].token_ids) == 3
    for p in ("alpha", "gamma"):
        assert final[p].error is None
        assert final[p].outputs[0].token_ids == expected[p]


@SCHEDULING
def test_stop_handling_error_fails_only_its_request(monkeypatch: pytest.MonkeyPatch, scheduling: str) -> None:
    prompts = ["alpha", "victim"]
    expected = reference(prompts)
    real_append = Sequence.append_token

    def append_token(self: Sequence, token_id, logprob):  # type: ignore[no-untyped-def]
        if self.group.request_id == "victim" and len(self.output_token_ids) == 5:
            raise ValueError("bad stop string")
        real_append(self, token_id, logprob)

    monkeypatch.setattr(Sequence, "append_token", append_token)
    engine = make_engine(async_scheduling=scheduling)
    engine.scheduler._start_steady_append = lambda seqs, now: None  # every token through append_token
    final = run_with_victim(engine, prompts)
    assert final["victim"].error == "ValueError: bad stop string"
    assert final["alpha"].outputs[0].token_ids == expected["alpha"]


@SCHEDULING
@pytest.mark.parametrize("steady", [False, True])
def test_detokenizing_error_fails_only_its_request(
    monkeypatch: pytest.MonkeyPatch, scheduling: str, steady: bool
) -> None:
    """A tokenizer that raises on a stream's token fails that request alone, whether the token is appended on its
    own or with a steady batch's (then the samples before it in the batch keep their tokens, and those after it
    get theirs). The victim's decoder takes no plain texts, so that a steady batch pushes it each token while it
    takes the others' texts for the batch."""
    prompts = ["alpha", "victim", "gamma"]
    expected = reference(prompts)
    real_push = Utf8StreamDecoder.push
    victims: set[int] = set()

    def push(self: Utf8StreamDecoder, token_id: int) -> str:
        pushed = getattr(self, "pushed", 0) + 1
        self.pushed = pushed  # type: ignore[attr-defined]
        if id(self) in victims and pushed == 6:
            raise RuntimeError("Invalid prefix encountered while decoding stream")
        return real_push(self, token_id)

    monkeypatch.setattr(Utf8StreamDecoder, "push", push)
    takes_plain = Utf8StreamDecoder.takes_plain.fget  # type: ignore[attr-defined]
    monkeypatch.setattr(Utf8StreamDecoder, "takes_plain", property(lambda self: id(self) not in victims
                                                                   and takes_plain(self)))  # fmt: skip
    engine = make_engine(async_scheduling=scheduling)
    if not steady:
        engine.scheduler._start_steady_append = lambda seqs, now: None  # type: ignore[method-assign]
    for p in prompts:
        engine.add_request(p, GREEDY, request_id=p)
    victims.add(id(engine.scheduler.waiting[1].seqs[0]._detokenizer))
    final = run_to_completion(engine)
    assert engine.pool.num_used == 0 and not engine.has_unfinished_requests()
    assert final["victim"].error == "RuntimeError: Invalid prefix encountered while decoding stream"
    assert final["victim"].outputs[0].finish_reason == "error"
    assert len(final["victim"].outputs[0].token_ids) == 6
    for p in ("alpha", "gamma"):
        assert final[p].error is None
        assert final[p].outputs[0].token_ids == expected[p]


@SCHEDULING
def test_an_error_decoding_a_final_output_fails_only_its_request(
    monkeypatch: pytest.MonkeyPatch, scheduling: str
) -> None:
    """A request that only wants its final output decodes its text when that output is built, outside the step's
    per-request handling: an error there (a tokenizer raising) ended the engine loop, failing every request."""
    prompts = ["alpha", "victim", "gamma"]
    expected = reference(prompts)
    real_decode = Sequence._decode_pending

    def decode_pending(self: Sequence) -> None:
        if self.group.request_id == "victim":
            raise RuntimeError("Invalid prefix encountered while decoding stream")
        real_decode(self)

    monkeypatch.setattr(Sequence, "_decode_pending", decode_pending)
    engine = make_engine(async_scheduling=scheduling)
    params = dataclasses.replace(GREEDY, output_kind=OutputKind.FINAL_ONLY)
    for p in prompts:
        engine.add_request(p, params, request_id=p)
    final = run_to_completion(engine)
    assert engine.pool.num_used == 0 and not engine.has_unfinished_requests()
    assert final["victim"].error == "RuntimeError: Invalid prefix encountered while decoding stream"
    assert final["victim"].outputs[0].finish_reason == "error"
    for p in ("alpha", "gamma"):
        assert final[p].error is None and final[p].outputs[0].token_ids == expected[p]
        assert final[p].outputs[0].text
    engine.add_request("after", params, request_id="after")
    assert run_to_completion(engine)["after"].outputs[0].finish_reason == "length"


@SCHEDULING
def test_prefill_error_fails_that_batch_and_spares_running_requests(
    monkeypatch: pytest.MonkeyPatch, scheduling: str
) -> None:
    engine = make_engine(async_scheduling=scheduling)
    expected = reference(["early"])
    engine.add_request("early", GREEDY, request_id="early")
    engine.step()
    real_prefill = engine.runner.prefill

    def prefill(chunks):  # type: ignore[no-untyped-def]
        if any(c.group.request_id == "late" for c in chunks):
            raise RuntimeError("kernel failed")
        return real_prefill(chunks)

    monkeypatch.setattr(engine.runner, "prefill", prefill)
    final = run_with_victim(engine, ["late"])
    assert final["late"].error == "RuntimeError: kernel failed"
    assert final["late"].outputs[0].token_ids == []
    assert final["early"].outputs[0].token_ids == expected["early"]


def test_outputs_carry_request_metrics() -> None:
    engine = make_engine()
    engine.add_request("abc", SamplingParams(temperature=0, max_tokens=3), request_id="r")
    out = run_to_completion(engine)["r"]
    m = out.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time <= m.finished_time
    assert m.previous_token_time is not None and m.previous_token_time <= m.last_token_time
