"""The prefix cache on CUDA with both tiers under pressure: demotions run on the cache's copy stream while steps
run (async scheduling, CUDA's default), no store, demotion or restore makes the host wait for the device, and
every state restored from either tier is the one stored, so outputs equal the cache-less engine's."""

from __future__ import annotations

import random

import pytest
import torch

from rnnserve.engine.outputs import RequestOutput
from tests.engine.cache_helpers import GREEDY, assert_same_outputs, make_engine, run, seeded, token_pool
from tests.engine.conftest import run_to_completion

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def never_waits(owner: object, name: str, ran: list[str]) -> None:
    """Make ``owner.name`` raise on any call that waits for the device (scheduling with its restores, launching
    with its prompt-end stores, appending tokens with its finish stores and demotions); each call appends
    ``name`` to ``ran``."""
    method = getattr(owner, name)

    def call(*args):  # type: ignore[no-untyped-def]
        torch.cuda.set_sync_debug_mode("error")
        try:
            return method(*args)
        finally:
            torch.cuda.set_sync_debug_mode(0)
            ran.append(name)

    setattr(owner, name, call)


@pytest.mark.parametrize("model", ["random:mamba-tiny", "random:mingru-tiny"])
def test_demotions_and_host_restores_serve_the_stored_states(model: str) -> None:
    probe = make_engine(model, cache=False, device="cuda")
    row = probe.pool.bytes_per_slot
    on = make_engine(model, cache=True, device="cuda", prefix_cache_memory=2 * row, prefix_cache_host_memory=6 * row)
    cache = on.prefix_cache
    assert cache is not None and cache._copy_stream is not None and on.config.async_scheduling != "off"
    tiers_hit: list[int] = []
    lookup = cache.lookup

    def spy(token_ids: list[int]):  # type: ignore[no-untyped-def]
        node = lookup(token_ids)
        if node is not None:
            tiers_hit.append(node.tier)
        return node

    cache.lookup = spy  # type: ignore[method-assign]
    ran: list[str] = []
    for owner, name in ((on.scheduler, "schedule"), (on, "_launch"), (on.scheduler, "postprocess")):
        never_waits(owner, name, ran)
    rng = random.Random(3)
    tokens = token_pool(on)
    stems = [rng.choices(tokens, k=rng.randint(8, 30)) for _ in range(6)]
    waves = []
    for wave in range(10):
        prompts = []
        for _ in range(5):
            stem = rng.choice(stems)
            prompts.append(stem[: rng.randint(1, len(stem))] + rng.choices(tokens, k=rng.randint(1, 12)))
        params = [GREEDY if i % 2 else seeded(wave * 10 + i) for i in range(len(prompts))]
        waves.append(list(zip(prompts, params, strict=True)))
    ids: list[str] = []
    final: dict[str, RequestOutput] = {}
    for wave in waves:
        ids += [on.add_request(prompt, params) for prompt, params in wave]
        for _ in range(3):  # the next wave arrives while this one runs
            for out in on.step():
                if out.finished:
                    final[out.request_id] = out
            cache.check_invariants()
    final.update(run_to_completion(on))
    cache.check_invariants()
    reference = run(probe, [request for wave in waves for request in wave])
    assert_same_outputs([final[i] for i in ids], reference)
    assert 0 in tiers_hit and 1 in tiers_hit, tiers_hit
    assert ran.count("postprocess") > 20
    assert cache.stats.evictions > 0 and [u.num_snapshots for u in cache.usage()] == [2, 6]
