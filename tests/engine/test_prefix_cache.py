"""Prefix state cache: a request that resumes from a snapshot generates exactly what it generates without the
cache, for every architecture, greedy and seeded, whatever prefix it hits (interval, prompt-end and finish
snapshots); eviction under pressure keeps that true; the radix tree's own operations; the CLI flag."""

from __future__ import annotations

import random
import re

import pytest
import torch

from rnnserve import SamplingParams
from rnnserve.engine import prefix_cache
from rnnserve.engine.llm_engine import LLMEngine
from rnnserve.engine.models.base import StateSpec
from rnnserve.engine.prefix_cache import PrefixCache, RadixNode
from rnnserve.engine.scheduler import PrefillChunk
from rnnserve.engine.sequence import Sequence
from rnnserve.server import cli
from rnnserve.server.config import ServerConfig
from rnnserve.server.metrics import ServerMetrics
from tests.engine.cache_helpers import (
    GREEDY,
    MODELS,
    assert_same_outputs,
    make_engine,
    run,
    run_waves,
    seeded,
    sharing_waves,
    token_pool,
)


@pytest.mark.parametrize("model", MODELS)
def test_cache_hits_generate_exactly_what_misses_generate(model: str) -> None:
    on, off = make_engine(model, cache=True), make_engine(model, cache=False)
    rng = random.Random(7)
    tokens = token_pool(on)
    base = rng.choices(tokens, k=21)  # snapshots at 8 and 16 (interval) and 21 (prompt end)
    (first,) = run(on, [(base, GREEDY)])
    assert_same_outputs([first], run(off, [(base, GREEDY)]))
    reply = first.outputs[0].token_ids  # its finish snapshot covers base + reply[:-1]: 25 tokens

    def extra(k: int) -> list[int]:
        return rng.choices(tokens, k=k)

    cases = [  # (prompt, tokens resumed from)
        (base[:8] + extra(6), 8),  # on an interval snapshot
        (base[:13] + extra(6), 8),  # between interval snapshots
        (base[:16] + extra(3), 16),
        (base + extra(4), 21),  # the prompt-end snapshot
        (base + reply + extra(4), 25),  # the finish snapshot: the next turn of a conversation
        (base, 16),  # the same prompt again: its last token must be prefilled
        (base[:3] + extra(12), 0),  # diverges before the shortest snapshot
    ]
    requests = [(prompt, GREEDY) for prompt, _ in cases]
    requests += [(prompt, seeded(i)) for i, (prompt, _) in enumerate(cases)]
    requests.append((base + reply + extra(2), seeded(99, n=2)))
    hits_before = on.prefix_cache.stats.hits
    outputs = run(on, requests)
    assert_same_outputs(outputs, run(off, requests))
    expected = [resumed for _, resumed in cases] * 2 + [25]
    assert [out.num_cached_tokens for out in outputs] == expected
    assert on.prefix_cache.stats.hits - hits_before == sum(1 for n in expected if n)
    assert all(out.num_cached_tokens == 0 for out in run(off, requests))
    on.prefix_cache.check_invariants()


def record_chunk_ends(engine: LLMEngine) -> list[int]:
    """A list that each prompt chunk the engine prefills from now on adds its end to."""
    chunk_ends: list[int] = []
    original = engine.scheduler.complete_prefill

    def record(chunks: list[PrefillChunk]) -> list[Sequence]:
        chunk_ends.extend(c.end for c in chunks)
        return original(chunks)

    engine.scheduler.complete_prefill = record  # type: ignore[method-assign]
    return chunk_ends


def test_long_prompts_resume_from_interval_snapshots_and_chunks_end_there() -> None:
    on, off = make_engine("random:mamba-tiny", cache=True), make_engine("random:mamba-tiny", cache=False)
    rng = random.Random(3)
    tokens = token_pool(on)
    shared = rng.choices(tokens, k=45)
    chunk_ends = record_chunk_ends(on)
    run(on, [(shared + [1, 2], GREEDY)])
    assert chunk_ends == [8, 16, 24, 32, 40, 47]
    requests = [(shared[:k] + rng.choices(tokens, k=5), GREEDY) for k in (9, 24, 31, 44)]
    outputs = run(on, requests)
    assert [o.num_cached_tokens for o in outputs] == [8, 24, 24, 40]
    assert_same_outputs(outputs, run(off, requests))


@pytest.mark.parametrize("model", ["random:mamba-tiny", "random:griffin-tiny"])
def test_a_shared_system_prompt_is_cached_where_conversations_branch_off_it(model: str) -> None:
    """Chats that share a system prompt and differ after it: no snapshot ended where they part (prompt ends,
    interval multiples and finished samples lie beyond it), so with the default interval none ever hit. The
    second chat's prefill now ends a chunk at the branch point and stores it, and every later chat resumes there."""
    on = make_engine(model, cache=True, prefix_cache_interval=2048)
    off = make_engine(model, cache=False)
    rng = random.Random(5)
    tokens = token_pool(on)
    system = rng.choices(tokens, k=40)
    chunk_ends = record_chunk_ends(on)
    chats = [system + rng.choices(tokens, k=12) for _ in range(4)]
    outputs = [run(on, [(chat, GREEDY)])[0] for chat in chats]
    assert [o.num_cached_tokens for o in outputs] == [0, 0, 40, 40]
    assert chunk_ends == [52, 40, 52, 52, 52]  # only the second chat stops at the branch point
    assert_same_outputs(outputs, run(off, [(chat, GREEDY) for chat in chats]))
    (short,) = run(on, [(system[:30] + rng.choices(tokens, k=3), GREEDY)])  # branches 30 tokens in
    assert short.num_cached_tokens == 0 and on.prefix_cache.shared_length(system[:30] + [-1]) == 30
    on.prefix_cache.check_invariants()


def test_prompt_logprobs_bypass_the_cache() -> None:
    engine = make_engine("random:mingru-tiny", cache=True)
    prompt = list(range(40, 70))
    run(engine, [(prompt + [1], GREEDY)])
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1)
    (out,) = run(engine, [(prompt + [1, 2], params)])
    assert out.num_cached_tokens == 0 and len(out.prompt_logprobs or []) == len(prompt) + 2
    (hit,) = run(engine, [(prompt + [1, 2], GREEDY)])
    assert hit.num_cached_tokens == len(prompt) + 1


def test_eviction_under_pressure_never_serves_a_wrong_state() -> None:
    """A budget of three snapshots, waves of prompts that share and diverge from a few stems, interleaved with
    running requests: outputs equal the cache-less engine's and the cache stays consistent after every step."""
    model = "random:griffin-tiny"
    probe = make_engine(model, cache=False)
    budget = 3 * probe.pool.bytes_per_slot
    on = make_engine(model, cache=True, prefix_cache_memory=budget)
    cache = on.prefix_cache
    waves = sharing_waves(on, random.Random(11), num_stems=4, num_waves=6)

    def check() -> None:
        cache.check_invariants()
        assert cache.num_snapshots <= 3

    outputs = run_waves(on, waves, check)
    cache.check_invariants()
    assert_same_outputs(outputs, run(probe, [request for wave in waves for request in wave]))
    assert cache.stats.hits > 0 and sum(out.num_cached_tokens for out in outputs) == cache.stats.hit_tokens
    assert cache.stats.evictions > 10
    usage = cache.usage()[0]
    assert usage.capacity_bytes == budget and usage.num_snapshots == cache.num_snapshots
    assert usage.used_bytes == cache.num_snapshots * probe.pool.bytes_per_slot + cache.key_bytes <= budget


# -- the radix tree and its tiers on their own ------------------------------------------------------------------

SPEC = [StateSpec("x", (2,), torch.float64)]


def toy_cache(snapshots: int, host_snapshots: int = 0, min_tokens: int = 1, token_bytes: int = 0) -> PrefixCache:
    """A cache of ``snapshots`` device rows and ``host_snapshots`` host rows; its keys are free unless
    ``token_bytes``."""
    row = SPEC[0].nbytes
    return PrefixCache(
        SPEC, torch.device("cpu"), snapshots * row, host_snapshots * row, min_tokens, host_tier=host_snapshots > 0,
        token_bytes=token_bytes,
    )  # fmt: skip


def state_of(tokens: list[int]) -> dict[str, torch.Tensor]:
    """A one-slot "state" that identifies its tokens: their count and a polynomial hash."""
    digest = 0.0
    for t in tokens:
        digest = (digest * 31 + t + 1) % 1_000_003
    return {"x": torch.tensor([[float(len(tokens)), digest]], dtype=torch.float64)}


def cached_keys(cache: PrefixCache) -> set[tuple[int, ...]]:
    keys = set()
    stack: list[tuple[RadixNode, tuple[int, ...]]] = [(cache.root, ())]
    while stack:
        node, path = stack.pop()
        if node.has_snapshot:
            keys.add(path)
        stack += [(child, path + tuple(child.key)) for child in node.children.values()]
    return keys


def restore(cache: PrefixCache, tokens: list[int]) -> tuple[int, torch.Tensor]:
    slot = {"x": torch.full((1, 2), -1.0, dtype=torch.float64)}
    return cache.restore(tokens, slot, 0), slot["x"][0]


def test_insert_split_lookup_and_prune() -> None:
    cache = toy_cache(8)
    for key in ([1, 2, 3, 4], [1, 2, 3, 4, 5, 6], [1, 2, 7]):
        assert cache.store(key, state_of(key), 0)
    assert not cache.store([1, 2, 3, 4], state_of([9]), 0)  # already cached: only touched
    cache.check_invariants()
    (a,) = cache.root.children.values()  # [1, 2] was split off when [1, 2, 7] diverged
    assert tuple(a.key) == (1, 2) and not a.has_snapshot
    assert sorted(tuple(c.key) for c in a.children.values()) == [(3, 4), (7,)]
    length, state = restore(cache, [1, 2, 3, 4, 5, 6, 9])
    assert length == 6 and state.tolist() == state_of([1, 2, 3, 4, 5, 6])["x"][0].tolist()
    assert restore(cache, [1, 2, 3, 4, 5, 6])[0] == 4  # one token is always left to prefill
    assert restore(cache, [1, 2, 3, 4, 5])[0] == 4
    assert restore(cache, [1, 2, 7, 7])[1].tolist() == state_of([1, 2, 7])["x"][0].tolist()
    assert restore(cache, [1, 2, 3])[0] == 0 and restore(cache, [5])[0] == 0
    assert restore(cache, [1, 2, 3, 5, 6, 7])[0] == 0  # diverges inside an edge
    stats = cache.stats
    assert (stats.queries, stats.hits, stats.hit_tokens) == (7, 4, 6 + 4 + 4 + 3)


def test_eviction_is_lru_leaf_first_and_prunes_and_merges() -> None:
    cache = toy_cache(3)
    for key in ([1, 2, 3], [1, 2, 3, 4, 5], [1, 2, 7]):
        cache.store(key, state_of(key), 0)
    cache.store([9], state_of([9]), 0)
    # [1, 2, 3] was stored first, but storing its descendant touched it: the descendant goes first
    assert cached_keys(cache) == {(1, 2, 3), (1, 2, 7), (9,)}
    restore(cache, [1, 2, 7, 0])
    cache.store([8, 8], state_of([8, 8]), 0)  # evicts [1, 2, 3], the least recently used
    assert cached_keys(cache) == {(1, 2, 7), (9,), (8, 8)}
    # its leaf was pruned and the empty [1, 2] node merged into its remaining child
    assert sorted(tuple(c.key) for c in cache.root.children.values()) == [(1, 2, 7), (8, 8), (9,)]
    cache.check_invariants()
    assert cache.stats.evictions == 2
    assert restore(cache, [1, 2, 7, 0])[1].tolist() == state_of([1, 2, 7])["x"][0].tolist()


def test_device_evictions_move_to_the_host_tier_and_drop_from_there() -> None:
    cache = toy_cache(1, host_snapshots=2)
    keys = [[1, 1], [2, 2], [3, 3], [4, 4]]
    for key in keys:
        cache.store(key, state_of(key), 0)
        cache.check_invariants()
    assert cached_keys(cache) == {(2, 2), (3, 3), (4, 4)}  # [1, 1] fell off the host tier
    assert [(u.name, u.num_snapshots) for u in cache.usage()] == [("device", 1), ("host", 2)]
    for key in keys[1:]:  # each restores its own state, from whichever tier holds it
        assert restore(cache, key + [0])[1].tolist() == state_of(key)["x"][0].tolist()


def test_the_keys_count_against_the_last_tiers_budget() -> None:
    """A snapshot's key may take more memory than its state (a 4,000-token prompt's tuple took 144 KB of host
    memory beside the default model's 15 KB state), and keys were not counted: 2,000 distinct long prompts under a
    64 MiB budget held 30 MB of snapshots and 288 MB of keys. Now keys are int64 arrays whose 8 bytes a token count
    against the last tier's budget, and least recently used snapshots are dropped to stay within it."""
    row = SPEC[0].nbytes  # 16 bytes: two tokens of key
    for host_snapshots in (0, 4):
        cache = toy_cache(4, host_snapshots, token_bytes=8)
        last = cache.tiers[-1]
        rng = random.Random(host_snapshots)
        for _ in range(200):
            key = [rng.randrange(4) for _ in range(rng.randint(1, 5))]
            cache.store(key, state_of(key), 0)
            cache.check_invariants()
            assert last.used_bytes + cache.key_bytes <= last.capacity_bytes
            assert cache.key_bytes == 8 * sum(len(node.key) for node in all_nodes(cache))
            for cached in cached_keys(cache):  # what stays is exact
                assert restore(cache, [*cached, 0])[1].tolist() == state_of(list(cached))["x"][0].tolist()
            probe = [rng.randrange(4) for _ in range(6)]
            shared = max((next((i for i, (a, b) in enumerate(zip(k, probe, strict=False)) if a != b), min(len(k), 6))
                          for k in cached_keys(cache)), default=0)  # fmt: skip
            assert cache.shared_length(probe) == shared
        assert cache.usage()[-1].used_bytes == last.used_bytes + cache.key_bytes
    cache = toy_cache(4, token_bytes=8)
    assert cache.store([1, 2], state_of([1, 2]), 0) and cached_keys(cache) == {(1, 2)}  # 16 + 16 of 64 bytes
    assert cache.store([1, 2, 3], state_of([1, 2, 3]), 0)  # 32 + 24: fits
    cache.store([5, 5, 5], state_of([5, 5, 5]), 0)  # 48 + 48: [1, 2] and [1, 2, 3] (least recent, leaf first) go
    assert cached_keys(cache) == {(5, 5, 5)} and cache.stats.evictions == 2
    huge = toy_cache(4, token_bytes=8)
    huge.store([7] * (4 * row // 8), state_of([7]), 0)  # its key alone fills the budget: nothing is kept
    assert cached_keys(huge) == set() and huge.num_key_tokens == 0
    huge.check_invariants()


def all_nodes(cache: PrefixCache) -> list[RadixNode]:
    nodes, stack = [], [cache.root]
    while stack:
        node = stack.pop()
        nodes.append(node)
        stack += node.children.values()
    return nodes


def test_min_tokens_and_a_zero_budget_store_nothing() -> None:
    cache = toy_cache(4, min_tokens=3)
    assert not cache.store([1, 2], state_of([1, 2]), 0) and cache.store([1, 2, 3], state_of([1, 2, 3]), 0)
    empty = toy_cache(0)
    assert not empty.store([1, 2, 3], state_of([1, 2, 3]), 0) and restore(empty, [1, 2, 3, 4])[0] == 0


def test_random_operations_keep_the_tree_consistent_and_lookups_exact() -> None:
    rng = random.Random(5)
    cache = toy_cache(6, host_snapshots=5)
    for _ in range(600):
        key = [rng.randrange(3) for _ in range(rng.randint(1, 9))]
        if rng.random() < 0.5:
            cache.store(key, state_of(key), 0)
        else:
            keys = cached_keys(cache)
            best = max((len(k) for k in keys if len(k) < len(key) and tuple(key[: len(k)]) == k), default=0)
            length, state = restore(cache, key)
            assert length == best
            if length:
                assert state.tolist() == state_of(key[:length])["x"][0].tolist()
        cache.check_invariants()
        assert cache.num_snapshots <= 11


@pytest.mark.parametrize("snapshots, host_snapshots, chunk_rows", [(1, 3, 8), (3, 0, 8), (4, 4, 8), (6, 2, 2)])
def test_batched_stores_equal_one_at_a_time_even_when_a_batch_evicts_its_own(
    snapshots: int, host_snapshots: int, chunk_rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``store_many`` gathers its copies at the end (``chunk_rows`` rows at a time), so a snapshot stored
    earlier in the same batch can be the victim of a later one (tiers smaller than a batch): demoted, it must
    carry its own state, and dropped, its row must end up with the newer state. The same stores one at a time
    are the reference."""
    monkeypatch.setattr(prefix_cache, "COPY_CHUNK_BYTES", chunk_rows * SPEC[0].nbytes)
    rng = random.Random(11)
    batched, single = toy_cache(snapshots, host_snapshots), toy_cache(snapshots, host_snapshots)
    for _ in range(150):
        keys = [[rng.randrange(3) for _ in range(rng.randint(1, 6))] for _ in range(rng.randint(1, 6))]
        slots = rng.sample(range(8), len(keys))
        state = {"x": torch.full((8, 2), -5.0, dtype=torch.float64)}
        for key, slot in zip(keys, slots, strict=True):
            state["x"][slot] = state_of(key)["x"][0]
        stored = batched.store_many(list(zip(keys, slots, strict=True)), state)
        assert stored == sum(single.store(key, state_of(key), 0) for key in keys)
        batched.check_invariants()
        assert cached_keys(batched) == cached_keys(single)
        for key in cached_keys(batched):
            length, restored = restore(batched, [*key, 0])
            assert length == len(key) and restored.tolist() == state_of(list(key))["x"][0].tolist()
            restore(single, [*key, 0])  # the same touches on both


def test_a_failed_batch_copy_leaves_no_snapshot_of_that_batch() -> None:
    """If the batched copy raises (on a GPU: out of memory for the gather), the batch's snapshots are unlinked
    and their rows freed, never served; snapshots of earlier batches stay."""
    cache = toy_cache(4)
    assert cache.store([1, 2, 3], state_of([1, 2, 3]), 0)
    wrong_dtype = {"x": torch.zeros((4, 2), dtype=torch.float32)}  # index_copy_ refuses to mix dtypes
    with pytest.raises(RuntimeError):
        cache.store_many([([1, 2, 3, 4], 0), ([1, 2, 5], 1), ([7, 7], 2), ([1, 2, 3], 3)], wrong_dtype)
    cache.check_invariants()
    assert cached_keys(cache) == {(1, 2, 3)}
    assert restore(cache, [1, 2, 3, 4, 5])[1].tolist() == state_of([1, 2, 3])["x"][0].tolist()
    assert cache.tiers[0].num_used == 1
    for key in ([1, 2, 3, 4], [1, 2, 5], [7, 7]):  # the rows are usable again
        assert cache.store(key, state_of(key), 0)
    cache.check_invariants()
    rng = random.Random(2)  # failures among random batches: the tree stays consistent and every state exact
    for _ in range(300):
        keys = [[rng.randrange(3) for _ in range(rng.randint(1, 6))] for _ in range(rng.randint(1, 5))]
        before = cached_keys(cache)
        if rng.random() < 0.3:
            if any(tuple(key) not in before for key in keys):  # something to copy: it raises
                with pytest.raises(RuntimeError):
                    cache.store_many([(key, 0) for key in keys], wrong_dtype)
            else:
                assert cache.store_many([(key, 0) for key in keys], wrong_dtype) == 0
            assert cached_keys(cache) <= before
        else:
            for key in keys:
                cache.store(key, state_of(key), 0)
        cache.check_invariants()
        for key in cached_keys(cache):
            assert restore(cache, [*key, 0])[1].tolist() == state_of(list(key))["x"][0].tolist()


def test_serve_no_prefix_cache_flag() -> None:
    parse = cli.build_parser().parse_args
    assert ServerConfig.from_args(parse(["serve"])).engine.enable_prefix_cache
    config = ServerConfig.from_args(
        parse(["serve", "--no-prefix-cache", "--prefix-cache-memory", "64MiB", "--prefix-cache-interval", "512"])
    )
    assert not config.engine.enable_prefix_cache
    assert (config.engine.prefix_cache_memory, config.engine.prefix_cache_interval) == (64 * 2**20, 512)


def test_prometheus_counters_and_gauges_follow_the_cache() -> None:
    """Fed the way the server feeds them (each step's stats and the load after it), the exported series equal
    the cache's own counts."""
    engine = make_engine("random:mingru-tiny", cache=True)
    metrics = ServerMetrics("tiny", engine.max_model_len)
    prompt = list(range(40, 70))
    for extra in ([1], [1, 2], [1, 2, 3]):
        engine.add_request(prompt + extra, GREEDY)
        while engine.has_unfinished_requests():
            outputs = engine.step()
            metrics.observe_step(engine.last_step)
            metrics.observe_outputs(outputs)
            metrics.set_load(engine.load())
    page = metrics.render().decode()
    stats = engine.prefix_cache.stats

    def sample(name: str, labels: str = 'model_name="tiny"') -> float:
        match = re.search(rf"^{name}\{{{labels}\}} (\S+)$", page, re.M)
        assert match is not None, name
        return float(match.group(1))

    assert (stats.queries, stats.hits, stats.hit_tokens) == (3, 2, 31 + 32)
    assert sample("rnnserve_prefix_cache_queries_total") == 3
    assert sample("rnnserve_prefix_cache_hits_total") == 2
    assert sample("rnnserve_prefix_cache_hit_tokens_total") == 63
    assert sample("rnnserve_prompt_tokens_total") == 31 + 32 + 33 - 63
    tier = 'model_name="tiny",tier="device"'
    (usage,) = engine.load().prefix_cache
    assert sample("rnnserve_prefix_cache_snapshots", tier) == usage.num_snapshots == engine.prefix_cache.num_snapshots
    used = usage.num_snapshots * engine.pool.bytes_per_slot + 8 * engine.prefix_cache.num_key_tokens
    assert sample("rnnserve_prefix_cache_memory_used_bytes", tier) == usage.used_bytes == used
    assert sample("rnnserve_prefix_cache_memory_total_bytes", tier) == usage.capacity_bytes > 0
