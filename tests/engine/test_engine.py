"""Scheduler and engine loop: batching equivalence, slot reuse, abort in every phase, constant memory."""

from __future__ import annotations

import gc
import resource

import pytest
import torch

from rnnserve.engine.sampling_params import SamplingParams
from rnnserve.engine.scheduler import QueueFullError
from tests.engine.conftest import make_engine, run_to_completion

PROMPTS = ["Hello there", "a", "The quick brown fox jumps over the lazy dog. " * 6, "xyz" * 40, "Zebra!"]


def _generate(engine, prompts, params) -> list[list[int]]:
    ids = [engine.add_request(p, params) for p in prompts]
    final = run_to_completion(engine)
    return [final[i].outputs[0].token_ids for i in ids]


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=0, max_tokens=24), SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=24)],
    ids=["greedy", "seeded"],
)
def test_batched_generation_equals_one_at_a_time(architecture: str, params: SamplingParams) -> None:
    batched = _generate(make_engine(architecture, max_num_batched_tokens=64), PROMPTS, params)
    single = [_generate(make_engine(architecture), [p], params)[0] for p in PROMPTS]
    assert batched == single
    assert all(len(t) == 24 for t in batched)


def test_long_prompt_is_prefilled_in_chunks_across_steps() -> None:
    engine = make_engine(max_num_batched_tokens=16)
    engine.add_request("x" * 50, SamplingParams(temperature=0, max_tokens=3))
    prefill_tokens = []
    while engine.has_unfinished_requests():
        engine.step()
        prefill_tokens.append(engine.last_step.prefill_tokens)
    assert prefill_tokens[:4] == [16, 16, 16, 2]
    reference = _generate(make_engine(), ["x" * 50], SamplingParams(temperature=0, max_tokens=3))
    chunked = make_engine(max_num_batched_tokens=7)
    assert _generate(chunked, ["x" * 50], SamplingParams(temperature=0, max_tokens=3)) == reference


def test_admission_is_fifo_and_bounded_by_free_slots() -> None:
    engine = make_engine(max_num_seqs=2)
    ids = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=4)) for p in ["a", "b", "c", "d"]]
    engine.step()
    assert engine.pool.num_used == 2
    assert [g.request_id for g in engine.scheduler.waiting] == ids[2:]
    assert set(engine.scheduler.running) == set(ids[:2])
    run_to_completion(engine)
    assert engine.pool.num_used == 0


def test_slot_reuse_after_finish_and_abort_matches_fresh_engine(architecture: str) -> None:
    params = SamplingParams(temperature=0, max_tokens=12)
    fresh = _generate(make_engine(architecture, max_num_seqs=1), ["reuse me"], params)
    engine = make_engine(architecture, max_num_seqs=1)
    _generate(engine, ["first request fills the slot with its state"], params)
    assert _generate(engine, ["reuse me"], params) == fresh
    rid = engine.add_request("an aborted one " * 5, params)
    engine.step()
    engine.step()
    assert engine.abort_request(rid)
    assert engine.pool.num_used == 0
    assert _generate(engine, ["reuse me"], params) == fresh


def test_abort_in_every_phase_frees_slots() -> None:
    engine = make_engine(max_num_seqs=2, max_num_batched_tokens=8)
    params = SamplingParams(temperature=0, max_tokens=50)
    decoding = engine.add_request("ab", params)
    prefilling = engine.add_request("long prompt " * 10, params)
    waiting = engine.add_request("waits", params)
    engine.step()
    engine.step()
    assert engine.scheduler.running[decoding].prefill_done
    assert not engine.scheduler.running[prefilling].prefill_done
    assert engine.abort_request(waiting)
    assert engine.abort_request(prefilling)
    assert engine.pool.num_used == 1
    assert engine.abort_request(decoding)
    assert engine.pool.num_used == 0 and not engine.has_unfinished_requests()
    assert not engine.abort_request("no-such-request")


def test_finished_requests_free_their_slot_in_the_same_step() -> None:
    engine = make_engine(max_num_seqs=4)
    engine.add_request("short", SamplingParams(temperature=0, max_tokens=1))
    outputs = engine.step()
    assert outputs[0].finished and engine.pool.num_used == 0


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_running_count_is_the_unfinished_samples_of_admitted_requests(async_scheduling: str) -> None:
    """``load().num_running`` (read every step) counts each admitted sample until it finishes, fails or is
    aborted: samples of one request that finish at different steps, a prefilling request, a waiting one."""
    engine = make_engine(max_num_seqs=6, max_num_batched_tokens=8, async_scheduling=async_scheduling)
    sampled = SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=40, stop_token_ids=list(range(40, 140)))
    engine.add_request("abc", sampled)
    engine.add_request("a long prompt " * 4, SamplingParams(temperature=0, max_tokens=30))
    aborted = engine.add_request("xy", SamplingParams(temperature=0, max_tokens=30))
    engine.add_request("waits", SamplingParams(n=2, temperature=0, max_tokens=5))
    counts = set()
    for step in range(200):
        if not engine.has_unfinished_requests():
            break
        if step == 3:
            engine.abort_request(aborted)
        engine.step()
        unfinished = sum(not s.finished for g in engine.scheduler.running.values() for s in g.seqs)
        assert engine.load().num_running == unfinished
        counts.add(unfinished)
    assert not engine.has_unfinished_requests() and engine.load().num_running == 0
    assert len(counts) >= 4  # samples finished one by one, not all at once


def test_waiting_queue_limit() -> None:
    engine = make_engine(max_num_seqs=1, max_waiting=2)
    for _ in range(3):  # the first takes the free slot at the next step: it does not wait
        engine.add_request("q", SamplingParams(max_tokens=2))
    with pytest.raises(QueueFullError):
        engine.add_request("q", SamplingParams(max_tokens=2))


def test_a_burst_into_an_idle_engine_is_refused_only_beyond_free_slots_and_the_queue() -> None:
    """Requests the free slots take at the next step do not count as waiting: a burst arriving between two steps
    was refused at ``max_waiting`` with every slot free."""
    engine = make_engine(max_num_seqs=4, max_waiting=2)
    engine.add_request("q", SamplingParams(max_tokens=2, n=3))
    for _ in range(3):  # one more fits the free slot; then two wait
        engine.add_request("q", SamplingParams(max_tokens=2))
    with pytest.raises(QueueFullError):
        engine.add_request("q", SamplingParams(max_tokens=2))
    engine.step()
    assert engine.scheduler.num_waiting == 2 and engine.pool.num_free == 0
    with pytest.raises(QueueFullError):
        engine.add_request("q", SamplingParams(max_tokens=2))


def test_state_memory_budget_sets_slot_count() -> None:
    probe = make_engine(max_num_seqs=1)
    per_slot = probe.pool.bytes_per_slot
    engine = make_engine(max_num_seqs=None, state_memory=per_slot * 5 + per_slot // 2)
    assert engine.pool.num_slots == 4  # and the scratch slot: the budget is all the pool allocates
    assert engine.pool.total_bytes == 4 * per_slot
    assert sum(t.nbytes for t in engine.pool.tensors.values()) == 5 * per_slot
    assert make_engine(max_num_seqs=None, state_memory=per_slot * 2).pool.num_slots == 1
    with pytest.raises(ValueError, match="below one slot and the pool's scratch slot"):
        make_engine(max_num_seqs=None, state_memory=per_slot * 2 - 1)


def _rss_kib() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def test_ten_thousand_tokens_leave_memory_flat() -> None:
    engine = make_engine(max_num_seqs=4)
    params = SamplingParams(temperature=1.0, max_tokens=2500, ignore_eos=True, seed=0)
    for i in range(4):
        engine.add_request(f"memory {i}", params)
    samples = []
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        if steps in (200, 2400):
            gc.collect()
            samples.append(_rss_kib())
    assert steps == 2500
    assert engine.pool.num_used == 0
    # 8,800 extra tokens after the first sample: state is constant, only the output lists grow (~100 KiB).
    assert samples[1] - samples[0] < 4 * 1024, samples


@torch.inference_mode()
def test_state_bytes_per_slot_match_the_spec(architecture: str) -> None:
    engine = make_engine(architecture, max_num_seqs=3)
    config = engine.model.config
    expected = 4 * config.n_layers * (config.d_model * (config.conv_kernel - 1) + config.d_hidden)
    assert engine.pool.bytes_per_slot == expected
    assert engine.pool.total_bytes == 3 * expected
    assert sum(t[:3].nbytes for t in engine.pool.tensors.values()) == engine.pool.total_bytes


def test_n_above_the_slot_count_is_a_parameter_error() -> None:
    from rnnserve.engine.sampling_params import InvalidParameterError

    engine = make_engine(max_num_seqs=2)
    with pytest.raises(InvalidParameterError) as err:
        engine.add_request("x", SamplingParams(n=3))
    assert err.value.param == "n"
