"""Final states read out on CUDA (``return_state``, what a session stores after each turn): no step makes the host
wait for the copy, the copies land in pinned host memory equal to the slot at the point the request finished,
while the freed slots are already reused, and a request continuing from one generates what sending the whole
history generates."""

from __future__ import annotations

import random

import pytest
import torch

from rnnserve import SamplingParams
from tests.engine.cache_helpers import GREEDY, assert_same_outputs, make_engine, random_tokens, run
from tests.engine.conftest import run_to_completion
from tests.gpu.device_waits import never_waits

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("model", ["random:mamba-tiny", "random:mamba2-tiny"])
def test_final_states_reach_the_host_beside_the_steps(model: str) -> None:
    engine = make_engine(model, cache=False, device="cuda", max_num_seqs=4)
    assert engine.async_scheduling
    pool = engine.scheduler.pool
    read = pool.read_slot
    copies: list[tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]] = []  # (device clone, host copy)

    def spy(slot: int):  # type: ignore[no-untyped-def]
        tensors, copied = read(slot)
        assert copied is not None
        copies.append(({name: t[slot].clone() for name, t in pool.tensors.items()}, tensors))
        return tensors, copied

    pool.read_slot = spy  # type: ignore[method-assign]
    ran: list[str] = []
    for owner, name in ((engine.scheduler, "schedule"), (engine, "_launch"), (engine.scheduler, "postprocess")):
        never_waits(owner, name, ran)
    rng = random.Random(7)
    prompts = [random_tokens(rng, engine, rng.randint(4, 20)) for _ in range(12)]
    lengths = [rng.randint(2, 14) for _ in prompts]  # finishing at different steps, their slots reused at once
    ids = [
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), return_state=True)
        for prompt, n in zip(prompts, lengths, strict=True)
    ]
    final = run_to_completion(engine)
    assert len(copies) == len(ids) and ran.count("postprocess") > 10
    torch.cuda.synchronize()
    for clone, host in copies:
        for name, tensor in clone.items():
            assert host[name].is_pinned() and torch.equal(host[name], tensor.cpu())
    for request_id, prompt in zip(ids, prompts, strict=True):
        state = final[request_id].final_state
        assert state is not None and state.token_ids[: len(prompt)] == prompt
        message = random_tokens(rng, engine, 3)
        continued = engine.add_request(message, GREEDY, context=state)
        history = state.token_ids + state.pending_token_ids + message
        assert_same_outputs([run_to_completion(engine)[continued]], run(engine, [(history, GREEDY)]))
