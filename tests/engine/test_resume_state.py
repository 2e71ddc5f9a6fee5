"""Exportable request state: a request that continues from another's ``final_state`` generates exactly what
sending the whole token history generates (every architecture, greedy and seeded, through a safetensors round
trip); bad contexts and unsupported combinations are 400s; the model fingerprint names model and weights."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load, save

from rnnserve import SamplingParams
from rnnserve.engine.config import EngineConfig
from rnnserve.engine.llm_engine import LLMEngine
from rnnserve.engine.outputs import RequestOutput
from rnnserve.engine.sampling_params import InvalidParameterError
from rnnserve.engine.state_snapshot import StateSnapshot
from rnnserve.engine.tokenizer import ByteTokenizer
from tests.engine.cache_helpers import (
    GREEDY,
    MODELS,
    assert_same_outputs,
    make_engine,
    random_tokens,
    run,
    seeded,
)
from tests.engine.conftest import run_to_completion, tiny_model


def finish(engine: LLMEngine, prompt: list[int] | str, params: SamplingParams, **kwargs: object) -> RequestOutput:
    """Run one request alone to completion; its final output."""
    request_id = engine.add_request(prompt, params, **kwargs)  # type: ignore[arg-type]
    return run_to_completion(engine)[request_id]


def round_trip(snapshot: StateSnapshot) -> StateSnapshot:
    """Through safetensors bytes, as a session store would keep it."""
    tensors = load(save(snapshot.tensors))
    return StateSnapshot(tensors, list(snapshot.token_ids), list(snapshot.pending_token_ids))


@pytest.mark.parametrize("model", MODELS)
def test_continuing_a_final_state_equals_sending_the_whole_history(model: str) -> None:
    # The reference has no prefix cache, so every token of the history is prefilled again.
    engine, reference = make_engine(model, cache=True), make_engine(model, cache=False)
    rng = random.Random(1)

    def check(out: RequestOutput, history: list[int], params: SamplingParams) -> StateSnapshot:
        assert out.prompt_token_ids == history
        assert_same_outputs([out], run(reference, [(history, params)]))
        state, tokens = out.final_state, out.outputs[0].token_ids
        assert state is not None and state.token_ids == history + tokens[:-1] and state.pending_token_ids == tokens[-1:]
        assert all(t.is_contiguous() and t.device.type == "cpu" for t in state.tensors.values())
        return state

    for params in (GREEDY, seeded(5)):
        history = random_tokens(rng, engine, 13)
        out = finish(engine, history, params, return_state=True)
        for message in (random_tokens(rng, engine, 4), []):  # [] continues from the pending token alone
            state = check(out, history, params)
            history = state.token_ids + state.pending_token_ids + message
            out = finish(engine, message, params, context=round_trip(state), return_state=True)
            assert out.num_cached_tokens == len(state.token_ids)
        check(out, history, params)
    assert engine.prefix_cache is not None and engine.prefix_cache.stats.queries == 2  # contexts bypass the cache


def test_final_state_is_the_slot_state_and_only_for_stop_and_length() -> None:
    engine = make_engine("random:mingru-tiny", cache=False)
    stopped = finish(engine, [72, 105], SamplingParams(temperature=0, max_tokens=3), return_state=True)
    assert stopped.outputs[0].finish_reason in ("stop", "length") and stopped.final_state is not None
    state = stopped.final_state
    assert {name: tuple(t.shape) for name, t in state.tensors.items()} == {
        spec.name: spec.shape for spec in engine.state_specs
    }
    assert finish(engine, [72, 105], SamplingParams(max_tokens=3)).final_state is None  # not asked for
    request_id = engine.add_request([72, 105], SamplingParams(max_tokens=50, ignore_eos=True), return_state=True)
    engine.step()
    aborted = engine.abort_request(request_id)
    assert aborted is not None and aborted.final_state is None


class SlowCopy:
    """Stands for the CUDA event of a state's copy to the host: not done for the first ``polls`` queries."""

    def __init__(self, polls: int) -> None:
        self.polls = polls
        self.waited = False

    def query(self) -> bool:
        self.polls -= 1
        return self.polls < 0

    def synchronize(self) -> None:
        self.waited = True
        self.polls = 0


def slow_copies(engine: LLMEngine, monkeypatch: pytest.MonkeyPatch, polls: int) -> list[tuple[int, SlowCopy]]:
    """Make every state the engine reads out take ``polls`` queries to arrive (as a copy from a GPU may); the
    copies, each with the number of steps the engine had started when it was made."""
    copies: list[tuple[int, SlowCopy]] = []
    read, step = engine.scheduler.pool.read_slot, engine.step
    started = [0]

    def counted_step(collect: bool = True) -> list[RequestOutput]:
        started[0] += 1
        return step(collect)

    def slow_read(slot: int) -> tuple[dict[str, torch.Tensor], SlowCopy]:
        tensors, copied = read(slot)
        assert copied is None  # a CPU engine's copy is done at once
        copies.append((started[0], SlowCopy(polls)))
        return tensors, copies[-1][1]

    monkeypatch.setattr(engine.scheduler.pool, "read_slot", slow_read)
    monkeypatch.setattr(engine, "step", counted_step)
    return copies


@pytest.mark.parametrize("mode", ["off", "on"])
def test_a_final_state_still_on_its_way_comes_with_a_later_step(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """While other requests keep the engine stepping, a finished request whose state copy has not arrived is
    left for a later collection, never waited for; its other outputs and everyone else's are not held back."""
    engine = make_engine("random:mingru-tiny", cache=False, async_scheduling=mode)
    reference = make_engine("random:mingru-tiny", cache=False, async_scheduling=mode)
    rng = random.Random(3)
    prompt, other = random_tokens(rng, engine, 9), random_tokens(rng, engine, 5)
    short = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    copies = slow_copies(engine, monkeypatch, polls=3)
    for each in (reference, engine):  # the same batches on both
        each.add_request(prompt, short, request_id="short", return_state=True)
        each.add_request(other, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), request_id="long")
    expected = run_to_completion(reference)["short"].final_state
    arrived: dict[str, int] = {}
    for step in range(1, 100):
        if not engine.has_unfinished_requests():
            break
        outputs = {out.request_id: out for out in engine.step()}
        assert "long" in outputs or (mode == "on" and step == 1)  # a token a step (its first a step late)
        if "short" in outputs and outputs["short"].finished:
            arrived["short"] = step
            final = outputs["short"]
        assert engine.has_uncollected_outputs == (bool(copies) and "short" not in arrived)
    [(made, copy)] = copies
    assert arrived["short"] == made + 3 and not copy.waited
    assert expected is not None and final.final_state is not None
    assert final.final_state.token_ids == expected.token_ids
    assert final.final_state.pending_token_ids == expected.pending_token_ids
    for name, tensor in expected.tensors.items():
        assert torch.equal(final.final_state.tensors[name], tensor)


def test_an_idle_engine_waits_for_a_final_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """With nothing else to run, the collection waits for the copy: the output is not left behind."""
    engine = make_engine("random:mingru-tiny", cache=False, async_scheduling="on")
    copies = slow_copies(engine, monkeypatch, polls=1000)
    out = finish(engine, [72, 105], SamplingParams(temperature=0, max_tokens=3), return_state=True)
    [(_, copy)] = copies
    assert copy.waited and out.final_state is not None and not engine.has_uncollected_outputs


def test_a_state_resumes_where_it_left_off_on_another_engine() -> None:
    """The same weights on two engines: a state taken from one continues on the other."""
    first, second = make_engine("random:mamba-tiny", cache=True), make_engine("random:mamba-tiny", cache=True)
    assert first.model_fingerprint == second.model_fingerprint
    out = finish(first, list(range(60, 90)), GREEDY, return_state=True)
    state = round_trip(out.final_state)  # type: ignore[arg-type]
    continued = finish(second, [65, 66], GREEDY, context=state)
    history = state.token_ids + state.pending_token_ids + [65, 66]
    assert_same_outputs([continued], [finish(first, history, GREEDY)])


def bad_context(engine: LLMEngine, **changes: object) -> StateSnapshot:
    state = finish(engine, [72, 105, 33], GREEDY, return_state=True).final_state
    assert state is not None
    tensors = dict(state.tensors)
    name = engine.state_specs[0].name
    change = changes.pop("tensor", None)
    if change == "missing":
        del tensors[name]
    elif change == "extra":
        tensors["unknown"] = torch.zeros(1)
    elif change == "shape":
        tensors[name] = tensors[name][..., :1].contiguous()
    elif change == "dtype":
        tensors[name] = tensors[name].double()
    return StateSnapshot(tensors, changes.get("token_ids", state.token_ids), changes.get("pending", [105]))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"tensor": "missing"}, "do not match"),
        ({"tensor": "extra"}, "do not match"),
        ({"tensor": "shape"}, "has shape"),
        ({"tensor": "dtype"}, "has dtype"),
        ({"pending": [100_000]}, "outside the vocabulary"),
        ({"token_ids": [1.5]}, "not an integer"),
    ],
)
def test_a_bad_context_is_a_400(change: dict, message: str) -> None:
    engine = make_engine("random:mingru-tiny", cache=True)
    with pytest.raises(InvalidParameterError, match=message) as err:
        engine.add_request("more", GREEDY, context=bad_context(engine, **change))
    assert err.value.param == "context"
    assert not engine.has_unfinished_requests()


def test_unsupported_combinations_are_400s() -> None:
    engine = make_engine("random:mingru-tiny", cache=True, max_model_len=64)
    state = bad_context(engine)
    with pytest.raises(InvalidParameterError, match="n=1") as err:
        engine.add_request("hi", SamplingParams(n=2), return_state=True)
    assert err.value.param == "n"
    with pytest.raises(InvalidParameterError) as err:
        engine.add_request("hi", SamplingParams(prompt_logprobs=1), context=state)
    assert err.value.param == "prompt_logprobs"
    with pytest.raises(InvalidParameterError, match="empty"):
        engine.add_request("", GREEDY, context=StateSnapshot(state.tensors, state.token_ids, []))
    with pytest.raises(InvalidParameterError, match="exceeds"):  # the limit counts the whole history
        engine.add_request("x" * 20, SamplingParams(max_tokens=40), context=state)
    engine.add_request("x" * 20, SamplingParams(max_tokens=40))  # the same prompt alone fits
    assert engine.scheduler.num_waiting == 1


def fingerprint_of(seed: int) -> str:
    return LLMEngine(tiny_model("mingru", seed=seed), ByteTokenizer(), EngineConfig(max_num_seqs=2)).model_fingerprint


def test_the_fingerprint_names_the_weights_and_is_stable_across_processes() -> None:
    assert fingerprint_of(0) == fingerprint_of(0)
    assert fingerprint_of(0) != fingerprint_of(1)
    assert len(fingerprint_of(0)) == 64 and int(fingerprint_of(0), 16) >= 0
    other = tiny_model("minlstm", seed=0)
    assert LLMEngine(other, ByteTokenizer(), EngineConfig(max_num_seqs=2)).model_fingerprint != fingerprint_of(0)
    code = (
        "import torch; torch.set_num_threads(2); from tests.engine.test_resume_state import fingerprint_of; "
        "print(fingerprint_of(0))"
    )
    root = Path(__file__).resolve().parents[2]
    child = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300, cwd=root
    )
    assert child.stdout.strip() == fingerprint_of(0)
