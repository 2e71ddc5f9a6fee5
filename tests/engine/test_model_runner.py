"""The model runner's decode inputs: each row feeds the position after everything its slot has consumed, also
when a steady batch reuses the previous step's slot and position tensors and when the batch changes around it
(arrivals, finishes, aborts, prompt tokens fed through the decode step, async scheduling)."""

from __future__ import annotations

import random

import pytest

from rnnserve import SamplingParams
from rnnserve.engine.models.base import DecodeBatch
from tests.engine.conftest import make_engine


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
@pytest.mark.parametrize("decoded_prompt_tokens", [0, 3])
def test_each_decode_row_feeds_the_position_after_what_its_slot_consumed(
    async_scheduling: str, decoded_prompt_tokens: int
) -> None:
    engine = make_engine(max_num_seqs=6, enable_prefix_cache=False, async_scheduling=async_scheduling,
                         decoded_prompt_tokens=decoded_prompt_tokens)  # fmt: skip
    model, scheduler = engine.runner.model, engine.scheduler
    decode = model.decode
    checked = {"rows": 0, "steady": 0}
    previous: list[int] = []

    def checked_decode(batch: DecodeBatch, state: object) -> object:
        expected = {}
        engine.runner.settle_fed()  # a steady batch's samples count what it fed once it ends, or when asked
        for group in scheduler.running.values():
            for seq in group.seqs:
                if seq.slot is None:
                    continue
                prompt = len(group.prompt_token_ids)
                fed = group.num_prefilled if group.num_prefilled < prompt else prompt + seq.num_fed
                expected[seq.slot] = fed
        slots = batch.slot_ids.tolist()
        assert batch.positions.tolist() == [expected[s] for s in slots]
        checked["rows"] += len(slots)
        checked["steady"] += slots == previous
        previous[:] = slots
        return decode(batch, state)

    model.decode = checked_decode
    rng = random.Random(0)
    for index in range(24):
        prompt = [rng.randrange(256) for _ in range(rng.randint(1, 9))]
        params = SamplingParams(temperature=0, max_tokens=rng.randint(1, 30), ignore_eos=True)
        engine.add_request(prompt, params, request_id=f"r{index}")
        for _ in range(rng.randint(0, 6)):
            engine.step()
        if index % 7 == 3 and scheduler.running:
            engine.abort_request(rng.choice(list(scheduler.running)))
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.pool.num_used == 0
    assert checked["rows"] > 200 and checked["steady"] > 10  # the steady path ran, and so did the others
