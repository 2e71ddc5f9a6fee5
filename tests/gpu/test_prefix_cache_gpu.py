"""The prefix cache on CUDA with both tiers under pressure: demotions run on the cache's copy stream while steps
run (async scheduling, CUDA's default), no store, demotion or restore makes the host wait for the device, and
every state restored from either tier is the one stored, so outputs equal the cache-less engine's."""

from __future__ import annotations

import random

import pytest
import torch

from tests.engine.cache_helpers import assert_same_outputs, make_engine, run, run_waves, sharing_waves
from tests.gpu.device_waits import never_waits

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("model", ["random:mamba-tiny", "random:mingru-tiny"])
def test_demotions_and_host_restores_serve_the_stored_states(model: str) -> None:
    probe = make_engine(model, cache=False, device="cuda")
    row = probe.pool.bytes_per_slot
    on = make_engine(model, cache=True, device="cuda", prefix_cache_memory=2 * row, prefix_cache_host_memory=6 * row)
    cache = on.prefix_cache
    assert cache is not None and cache._copy_stream is not None and on.async_scheduling
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
    waves = sharing_waves(on, random.Random(3), num_stems=6, num_waves=10)
    outputs = run_waves(on, waves, cache.check_invariants)
    cache.check_invariants()
    assert_same_outputs(outputs, run(probe, [request for wave in waves for request in wave]))
    assert 0 in tiers_hit and 1 in tiers_hit, tiers_hit
    assert ran.count("postprocess") > 20
    device, host = cache.usage()  # the host tier's budget holds the tree's keys beside its rows
    assert cache.stats.evictions > 0 and device.num_snapshots == 2 and 0 < host.num_snapshots <= 6
    assert host.used_bytes == host.num_snapshots * row + cache.key_bytes <= host.capacity_bytes
