"""Prefix state cache: copies of request states keyed by the tokens they consumed, so a new request whose
prompt starts with a cached sequence resumes from its state and prefills only the rest.

A recurrent state after ``k`` tokens summarises exactly those ``k`` tokens, so one snapshot serves every
prompt that extends them. Snapshots hang off the nodes of a radix tree (a compressed trie) over token ids;
the path from the root to a node spells the tokens its snapshot consumed. They live in fixed-size
:class:`SnapshotTier` rows budgeted in bytes: the model's device first and, when that is not the CPU, a host
tier (pinned on CUDA) that device evictions are demoted to. Eviction is least-recently-used; a lookup or store
touches every snapshot on its path, so an ancestor is never older than its descendants and the victim is
always a leaf-most snapshot. A node left without snapshot and children is pruned, and one with a single child
is merged into it. The tree's keys are int64 arrays (8 bytes a token, no int object per token) and count against
the last tier's budget, so a flood of long distinct prompts cannot grow host memory past it.

Every copy (slot to row, row to row, row to slot) is queued on the engine thread, in the device's order, by the
call that asks for it (the slot-to-row copies of one ``store_many`` together at its end, or before a demotion
reads a row they fill), so a row is reused only after its node is unlinked and no request can receive a stale or
foreign state. Host-tier rows are only ever read and written by such queued copies, so they need not wait. On
CUDA, demotions run on a copy stream of their own, ordered against the stores and restores of the same rows by
events, so a device-to-host copy overlaps the steps instead of queuing between them.
"""

from __future__ import annotations

import heapq
import itertools
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rnnserve.engine.models.base import StateSpec, long_tensor

COPY_CHUNK_BYTES = 64 * 2**20  # a batched store gathers at most this much state at a time
TOKEN_BYTES = 8  # host memory of one token of the tree's keys (an int64 array element)


def token_array(tokens: Sequence[int] = ()) -> array[int]:
    """Tokens as the tree keeps them: an int64 array (a tuple costs 8 bytes a token plus an int object each)."""
    return array("q", tokens)


class SnapshotTier:
    """``num_rows`` snapshot rows of every state tensor on one device: ``[num_rows, *spec.shape]`` each,
    allocated when the first snapshot arrives (a host tier that is never needed costs no pinned memory)."""

    def __init__(
        self, name: str, specs: list[StateSpec], budget_bytes: int, device: torch.device, pin_memory: bool = False
    ) -> None:
        self.name = name
        self.specs = specs
        self.device = device
        self.pin_memory = pin_memory
        self.bytes_per_row = sum(s.nbytes for s in specs)
        self.num_rows = budget_bytes // self.bytes_per_row if self.bytes_per_row else 0
        self._tensors: dict[str, torch.Tensor] | None = None
        self._released: list[int] = []
        self._next_unused = 0  # rows from here on were never handed out (no free list of a million ints)

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        if self._tensors is None:
            self._tensors = {
                s.name: torch.empty(
                    (self.num_rows, *s.shape), dtype=s.dtype, device=self.device, pin_memory=self.pin_memory
                )
                for s in self.specs
            }
        return self._tensors

    @property
    def num_used(self) -> int:
        return self._next_unused - len(self._released)

    @property
    def used_bytes(self) -> int:
        return self.num_used * self.bytes_per_row

    @property
    def capacity_bytes(self) -> int:
        return self.num_rows * self.bytes_per_row

    def allocate(self) -> int | None:
        """A free row, or ``None`` when every row holds a snapshot."""
        if self._released:
            return self._released.pop()
        if self._next_unused < self.num_rows:
            self._next_unused += 1
            return self._next_unused - 1
        return None

    def release(self, row: int) -> None:
        self._released.append(row)


class RadixNode:
    """A tree node: ``key`` is the token run on the edge from its parent (an int64 array), ``depth`` the tokens
    from the root to its end; ``tier``/``row`` locate its snapshot (``None`` when it has none)."""

    __slots__ = ("key", "parent", "children", "depth", "tier", "row", "stamp")

    def __init__(self, key: array[int], parent: RadixNode | None) -> None:
        self.key = key
        self.parent = parent
        self.children: dict[int, RadixNode] = {}
        self.depth = (parent.depth if parent is not None else 0) + len(key)
        self.tier: int | None = None
        self.row: int | None = None
        self.stamp = 0

    @property
    def has_snapshot(self) -> bool:
        return self.row is not None


@dataclass
class PrefixCacheStats:
    """Cumulative counts: requests looked up, requests that resumed from a snapshot, prompt tokens they skipped,
    snapshots stored and snapshots evicted from the last tier."""

    queries: int = 0
    hits: int = 0
    hit_tokens: int = 0
    stores: int = 0
    evictions: int = 0


@dataclass
class TierUsage:
    """One tier's snapshot memory (for gauges); the last tier's ``used_bytes`` includes the tree's keys."""

    name: str
    used_bytes: int
    capacity_bytes: int
    num_snapshots: int


class PrefixCache:
    """The radix tree of snapshots and its tiers (engine thread only).

    ``min_tokens``: shorter sequences are not stored (a snapshot costs a whole state whatever its length; a
    handful of tokens is cheaper to prefill again). ``host_tier`` (default: when ``device`` is not the CPU)
    adds the host tier of ``host_bytes`` below the device tier of ``device_bytes``. ``token_bytes``: the host
    memory charged to the last tier's budget per token of the tree's keys (0: keys are free).
    """

    def __init__(
        self,
        specs: list[StateSpec],
        device: torch.device,
        device_bytes: int,
        host_bytes: int,
        min_tokens: int = 1,
        host_tier: bool | None = None,
        token_bytes: int = TOKEN_BYTES,
    ) -> None:
        tiers = [SnapshotTier("device", specs, device_bytes, device)]
        if host_tier is None:
            host_tier = device.type != "cpu"
        if host_tier:
            pin = device.type == "cuda"
            tiers.append(SnapshotTier("host", specs, host_bytes, torch.device("cpu"), pin_memory=pin))
        self.all_tiers = tiers
        self.tiers = [t for t in tiers if t.num_rows > 0]  # where snapshots go, fastest first
        self.min_tokens = max(1, min_tokens)
        self.token_bytes = token_bytes
        self.num_key_tokens = 0  # tokens on the tree's edges
        self.root = RadixNode(token_array(), None)
        self.stats = PrefixCacheStats()
        self._clock = itertools.count(1)
        self._serial = itertools.count()
        self._lru: list[list[tuple[int, int, int, RadixNode]]] = [[] for _ in self.tiers]
        self._live = [0] * len(self.tiers)
        self._pending: dict[int, int] = {}  # device-tier row -> the slot to copy into it (store_many)
        self._pending_state: dict[str, torch.Tensor] = {}
        # On CUDA, demotions copy down on a stream of their own, overlapping the steps; events order each row's
        # copies on the two streams (see _demote).
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" and len(self.tiers) > 1 else None
        self._row_written: dict[int, torch.cuda.Event] = {}  # device row -> after the store that filled it
        self._row_drained: dict[int, torch.cuda.Event] = {}  # device row -> after the demotion that read it
        self._host_written: dict[int, torch.cuda.Event] = {}  # host row -> after the demotion that filled it
        self._host_read: dict[int, torch.cuda.Event] = {}  # host row -> after the last restore that read it

    # -- requests -------------------------------------------------------------------------------------------

    def restore(self, token_ids: list[int], state: dict[str, torch.Tensor], slot: int) -> int:
        """Copy the deepest snapshot whose tokens are a prefix of ``token_ids`` (leaving at least one token to
        prefill: the last one's logits are needed) into ``state``'s ``slot``; return its length (0: a miss)."""
        self.stats.queries += 1
        node = self.lookup(token_ids)
        if node is None:
            return 0
        rows = self.tiers[node.tier].tensors  # type: ignore[index]
        row = node.row
        assert row is not None
        from_host = self._copy_stream is not None and node.tier == 1
        if from_host:
            compute = torch.cuda.current_stream(self.tiers[0].device)
            if row in self._host_written:
                compute.wait_event(self._host_written[row])
        for name, tensor in state.items():
            tensor[slot].copy_(rows[name][row], non_blocking=True)
        if from_host:
            self._host_read[row] = self._record(compute)
        self.stats.hits += 1
        self.stats.hit_tokens += node.depth
        return node.depth

    def store(self, token_ids: list[int], state: dict[str, torch.Tensor], slot: int) -> bool:
        """Copy ``state``'s ``slot`` (which has consumed exactly ``token_ids``) into a snapshot, evicting the
        least recently used one if needed. A sequence already cached is only touched. Returns whether a new
        snapshot was stored."""
        return self.store_many([(token_ids, slot)], state) == 1

    def store_many(self, sequences: list[tuple[list[int], int]], state: dict[str, torch.Tensor]) -> int:
        """:meth:`store` each ``(token_ids, slot)`` in order, the copies of all of them batched into a few
        gathers per state tensor (a step that ends or prefills many requests stores them together). Returns
        how many new snapshots were stored."""
        if not self.tiers:
            return 0
        self._pending_state = state
        stored = 0
        try:
            for token_ids, slot in sequences:
                if len(token_ids) < self.min_tokens:
                    continue
                existing = self._exact(token_ids)
                if existing is not None and existing.has_snapshot:
                    self._touch(existing)
                    continue
                row = self._free_row(0)  # may evict, which may prune nodes: walk the tree again afterwards
                self._pending[row] = slot  # replaces the copy of a snapshot evicted from this row meanwhile
                node = self._insert_path(token_array(token_ids))
                node.tier, node.row = 0, row
                self._live[0] += 1
                self.stats.stores += 1
                self._touch(node)
                stored += 1
        finally:
            self._flush()
        self._shed()
        return stored

    @property
    def key_bytes(self) -> int:
        """Host memory charged for the tree's keys."""
        return self.num_key_tokens * self.token_bytes

    def _shed(self) -> None:
        """Drop least recently used snapshots (the last tier's first) while the last tier's rows and the tree's
        keys pass its budget: a snapshot's state may be small (15 KB for the default model) and its key long (a
        4,000-token prompt takes 32 KB), and the keys would otherwise grow without bound."""
        last = self.tiers[-1]
        while self.num_key_tokens and last.used_bytes + self.key_bytes > last.capacity_bytes:
            victim = next(
                (node for tier in reversed(range(len(self.tiers))) if (node := self._pop_lru(tier)) is not None), None
            )
            assert victim is not None, "every key leads to a snapshot"
            tier = self.tiers[victim.tier]  # type: ignore[index]
            tier.release(self._drop(victim))

    def _flush(self) -> None:
        """Copy the pending slots into their device-tier rows, at most ``COPY_CHUNK_BYTES`` of gathered state
        at a time."""
        if not self._pending:
            return
        rows, slots = list(self._pending), list(self._pending.values())
        self._pending = {}
        tier = self.tiers[0]
        target, device = tier.tensors, tier.device
        compute = torch.cuda.current_stream(device) if self._copy_stream is not None else None
        if compute is not None:
            for row in rows:
                drained = self._row_drained.pop(row, None)
                if drained is not None:  # a demotion still reading the row's previous snapshot
                    compute.wait_event(drained)
        chunk = max(1, COPY_CHUNK_BYTES // tier.bytes_per_row)
        try:
            for start in range(0, len(rows), chunk):
                row_index = long_tensor(rows[start : start + chunk], device)
                slot_index = long_tensor(slots[start : start + chunk], device)
                for name, tensor in self._pending_state.items():
                    target[name].index_copy_(0, row_index, tensor.index_select(0, slot_index))
        except BaseException:
            self._drop_rows(set(rows))  # never serve a snapshot whose copy may not have happened
            raise
        if compute is not None:
            written = self._record(compute)
            for row in rows:
                self._row_written[row] = written

    def _drop_rows(self, rows: set[int]) -> None:
        """Unlink the device-tier snapshots in ``rows`` and free the rows (all of them: a row whose snapshot was
        not linked yet is freed too)."""
        dropped = []
        stack = [self.root]
        while stack:
            node = stack.pop()
            stack += node.children.values()
            if node.tier == 0 and node.row in rows:
                node.tier = node.row = None
                self._live[0] -= 1
                dropped.append(node)
        for row in rows:
            self.tiers[0].release(row)
        for node in dropped:  # parents first: pruning one never unlinks a node pruned after it
            self._prune(node)

    def _demote(self, row: int, lower: int) -> None:
        """Copy device-tier row ``row`` into host-tier row ``lower``. On CUDA the copy runs on the copy stream
        after the store that filled ``row`` and the restores that read ``lower`` before, and the next store into
        ``row`` and every restore from ``lower`` wait for it: the device's steps never wait for a demotion."""
        source, target = self.tiers[0].tensors, self.tiers[1].tensors
        if self._copy_stream is None:
            for name, tensor in target.items():
                tensor[lower].copy_(source[name][row], non_blocking=True)
            return
        stream = self._copy_stream
        for event in (self._row_written.get(row), self._host_read.pop(lower, None)):
            if event is not None:
                stream.wait_event(event)
        with torch.cuda.stream(stream):
            for name, tensor in target.items():
                tensor[lower].copy_(source[name][row], non_blocking=True)
        done = self._record(stream)
        self._row_drained[row] = self._host_written[lower] = done

    @staticmethod
    def _record(stream: torch.cuda.Stream) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(stream)
        return event

    # -- tree -----------------------------------------------------------------------------------------------

    def lookup(self, token_ids: list[int]) -> RadixNode | None:
        """The deepest snapshot node on ``token_ids``'s path with at most ``len(token_ids) - 1`` tokens; it and
        its snapshot ancestors are touched."""
        limit = len(token_ids) - 1
        node, matched, best = self.root, 0, None
        while matched < limit:
            child = node.children.get(token_ids[matched])
            if child is None or child.depth > limit or token_array(token_ids[matched : child.depth]) != child.key:
                break
            node, matched = child, child.depth
            if node.has_snapshot:
                best = node
        if best is not None:
            self._touch(best)
        return best

    def shared_length(self, token_ids: list[int]) -> int:
        """How many leading tokens ``token_ids`` shares with a sequence the tree holds (a snapshot or not on the
        way): where a new prompt branches off a cached one, e.g. after a shared system prompt. Touches nothing."""
        node, matched = self.root, 0
        while matched < len(token_ids):
            child = node.children.get(token_ids[matched])
            if child is None:
                break
            common = _shared_run(child.key, token_ids, matched)
            matched += common
            if common < len(child.key):
                break
            node = child
        return matched

    def _exact(self, token_ids: list[int]) -> RadixNode | None:
        """The node that ends exactly after ``token_ids``, if the tree has one."""
        node, matched = self.root, 0
        while matched < len(token_ids):
            child = node.children.get(token_ids[matched])
            if child is None or token_array(token_ids[matched : child.depth]) != child.key:
                return None
            node, matched = child, child.depth
        return node

    def _insert_path(self, tokens: array[int]) -> RadixNode:
        """The node ending exactly after ``tokens``, creating it (and splitting an edge) as needed."""
        node, matched = self.root, 0
        while matched < len(tokens):
            child = node.children.get(tokens[matched])
            if child is None:
                leaf = RadixNode(tokens[matched:], node)
                node.children[tokens[matched]] = leaf
                self.num_key_tokens += len(leaf.key)
                return leaf
            if tokens[matched : child.depth] != child.key:  # the edge diverges or is longer: split it
                child = self._split(child, _shared_run(child.key, tokens, matched))
            node, matched = child, child.depth
        return node

    @staticmethod
    def _split(node: RadixNode, at: int) -> RadixNode:
        """Cut ``node``'s edge after ``at`` tokens; returns the new middle node (``node`` keeps its identity)."""
        parent = node.parent
        assert parent is not None
        middle = RadixNode(node.key[:at], parent)
        parent.children[middle.key[0]] = middle
        node.key = node.key[at:]
        node.parent = middle
        middle.children[node.key[0]] = node
        return middle

    def _prune(self, node: RadixNode) -> None:
        """Remove snapshot-less leaves upwards from ``node`` and merge a snapshot-less node into its only child."""
        while node is not self.root and not node.has_snapshot:
            parent = node.parent
            assert parent is not None
            if not node.children:
                del parent.children[node.key[0]]
                self.num_key_tokens -= len(node.key)
                node = parent
                continue
            if len(node.children) == 1:
                (child,) = node.children.values()
                child.key = node.key + child.key
                child.parent = parent
                parent.children[child.key[0]] = child
            return

    # -- snapshot rows and eviction -------------------------------------------------------------------------

    def _touch(self, node: RadixNode) -> None:
        """Mark ``node`` and every snapshot above it as used now (ancestors are never older than descendants)."""
        stamp = next(self._clock)
        current: RadixNode | None = node
        while current is not None:
            if current.has_snapshot:
                current.stamp = stamp
                self._push(current)
            current = current.parent

    def _push(self, node: RadixNode) -> None:
        tier = node.tier
        assert tier is not None
        heap = self._lru[tier]
        heapq.heappush(heap, (node.stamp, -node.depth, next(self._serial), node))
        if len(heap) > 2 * self._live[tier] + 64:  # drop stale entries
            live = [e for e in heap if e[3].tier == tier and e[3].stamp == e[0]]
            heapq.heapify(live)
            self._lru[tier] = live

    def _pop_lru(self, tier: int) -> RadixNode | None:
        """The least recently used snapshot of ``tier`` (the deepest on ties), taken off its heap."""
        heap = self._lru[tier]
        while heap:
            stamp, _, _, node = heapq.heappop(heap)
            if node.tier == tier and node.stamp == stamp:
                return node
        return None

    def _free_row(self, tier: int) -> int:
        """A row of ``tier`` for a new snapshot: a free one, else the LRU snapshot's, which moves down a tier
        (or is dropped from the last)."""
        row = self.tiers[tier].allocate()
        if row is not None:
            return row
        victim = self._pop_lru(tier)
        assert victim is not None and victim.row is not None, "a full tier has snapshots"
        row = victim.row
        if tier + 1 < len(self.tiers):
            if tier == 0 and row in self._pending:
                self._flush()  # the victim was stored in this batch: its state must be in its row first
            lower = self._free_row(tier + 1)
            self._demote(row, lower)
            victim.tier, victim.row = tier + 1, lower
            self._live[tier] -= 1
            self._live[tier + 1] += 1
            self._push(victim)
        else:
            self._drop(victim)
        return row

    def _drop(self, victim: RadixNode) -> int:
        """Evict ``victim``'s snapshot for good (pruning the tree); returns its row, which the caller reuses or
        releases."""
        tier, row = victim.tier, victim.row
        assert tier is not None and row is not None
        victim.tier = victim.row = None
        self._live[tier] -= 1
        self.stats.evictions += 1
        self._prune(victim)
        return row

    # -- introspection --------------------------------------------------------------------------------------

    @property
    def num_snapshots(self) -> int:
        return sum(self._live)

    def usage(self) -> list[TierUsage]:
        """Memory and snapshot count of every tier (an empty tier reports zero capacity); the last tier's memory
        includes the tree's keys."""
        live = {id(t): n for t, n in zip(self.tiers, self._live, strict=True)}
        keys = {id(self.tiers[-1]): self.key_bytes} if self.tiers else {}
        return [
            TierUsage(t.name, t.used_bytes + keys.get(id(t), 0), t.capacity_bytes, live.get(id(t), 0))
            for t in self.all_tiers
        ]

    def check_invariants(self) -> None:
        """Raise AssertionError if the tree or the tiers are inconsistent (for tests)."""
        seen: dict[tuple[int, int], RadixNode] = {}
        key_tokens = 0
        stack = [self.root]
        while stack:
            node = stack.pop()
            key_tokens += len(node.key)
            for first, child in node.children.items():
                assert child.parent is node and child.key and child.key[0] == first
                assert child.depth == node.depth + len(child.key)
                assert child.has_snapshot or len(child.children) >= 2, "an empty node must branch"
                stack.append(child)
            if node.has_snapshot:
                assert node.tier is not None and node.row is not None
                assert (node.tier, node.row) not in seen, "a row referenced twice"
                seen[(node.tier, node.row)] = node
        for index, tier in enumerate(self.tiers):
            rows = sorted(row for t, row in seen if t == index)
            assert len(rows) == tier.num_used == self._live[index]
            assert rows == sorted(set(range(tier._next_unused)) - set(tier._released))
            assert tier.used_bytes <= tier.capacity_bytes
        assert key_tokens == self.num_key_tokens
        if self.tiers:
            assert self.tiers[-1].used_bytes + self.key_bytes <= self.tiers[-1].capacity_bytes


def _shared_run(key: array[int], tokens: Sequence[int], start: int) -> int:
    """How many of an edge's ``key`` tokens ``tokens`` repeats from ``start`` on. Compares array slices (a memcmp
    each), halving the range that holds the first difference: no Python loop over tokens (a prompt that branched
    off a 32,000-token edge took 55 ms per admission)."""
    limit = min(len(key), len(tokens) - start)
    other = token_array(tokens[start : start + limit])
    if key[:limit] == other:
        return limit
    low, high = 0, limit  # key[:low] == other[:low] and key[:high] != other[:high]
    while high - low > 1:
        middle = (low + high) // 2
        if key[low:middle] == other[low:middle]:
            low = middle
        else:
            high = middle
    return low
