"""Continuous batching over a fixed pool of state slots.

A request is admitted (FIFO) when the pool has a free slot for each of its ``n`` samples; there is no
preemption, because a running request's memory never grows. Each step the scheduler picks, within a
token budget, the next prompt chunks to prefill (a long prompt is split across steps with its state
carried in its slot) and every running sample that is ready to decode.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from rnnserve.engine.sampling_params import InvalidParameterError
from rnnserve.engine.sequence import Sequence, SequenceGroup, SequenceStatus
from rnnserve.engine.state_pool import StatePool


@dataclass
class PrefillChunk:
    group: SequenceGroup
    start: int
    end: int

    @property
    def token_ids(self) -> list[int]:
        return self.group.prompt_token_ids[self.start : self.end]

    @property
    def completes_prompt(self) -> bool:
        return self.end == len(self.group.prompt_token_ids)


@dataclass
class SchedulerOutput:
    prefill: list[PrefillChunk] = field(default_factory=list)
    decode: list[Sequence] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.prefill and not self.decode


class QueueFullError(RuntimeError):
    """The waiting queue is at its limit; the caller should retry later."""


class Scheduler:
    """Admits waiting requests into free slots and forms each step's prefill and decode batches."""

    def __init__(self, pool: StatePool, max_num_batched_tokens: int, max_waiting: int | None = None) -> None:
        if max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        self.pool = pool
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_waiting = max_waiting
        self.waiting: deque[SequenceGroup] = deque()
        self.running: dict[str, SequenceGroup] = {}

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return sum(1 for g in self.running.values() for s in g.seqs if not s.finished)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, group: SequenceGroup) -> None:
        if group.params.n > self.pool.num_slots:
            raise InvalidParameterError("n", f"n={group.params.n} exceeds the {self.pool.num_slots} state slots")
        if self.max_waiting is not None and len(self.waiting) >= self.max_waiting:
            raise QueueFullError(f"waiting queue is full ({self.max_waiting} requests)")
        self.waiting.append(group)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        out.decode = [
            s for g in self.running.values() if g.prefill_done for s in g.seqs if not s.finished
        ]
        while self.waiting and self.pool.num_free >= self.waiting[0].params.n:
            group = self.waiting.popleft()
            slots = self.pool.allocate(group.params.n)
            for seq, slot in zip(group.seqs, slots, strict=True):
                seq.slot = slot
            group.status = SequenceStatus.RUNNING
            self.running[group.request_id] = group
        budget = self.max_num_batched_tokens
        for group in self.running.values():
            if budget == 0:
                break
            if group.prefill_done:
                continue
            end = min(len(group.prompt_token_ids), group.num_prefilled + budget)
            out.prefill.append(PrefillChunk(group, group.num_prefilled, end))
            budget -= end - group.num_prefilled
        return out

    def finish_sequence(self, seq: Sequence) -> None:
        """Free a finished sample's slot at once; drop the request when all its samples are done."""
        if seq.slot is not None:
            self.pool.free([seq.slot])
            seq.slot = None
        if seq.group.finished:
            seq.group.status = SequenceStatus.FINISHED
            self.running.pop(seq.group.request_id, None)

    def abort(self, request_id: str) -> SequenceGroup | None:
        """Remove a request in any phase and free its slots. Returns the group, or None if unknown."""
        for group in self.waiting:
            if group.request_id == request_id:
                self.waiting.remove(group)
                self._mark_aborted(group)
                return group
        group = self.running.pop(request_id, None)
        if group is None:
            return None
        self.pool.free([s.slot for s in group.seqs if s.slot is not None])
        self._mark_aborted(group)
        return group

    @staticmethod
    def _mark_aborted(group: SequenceGroup) -> None:
        for seq in group.seqs:
            seq.slot = None
            if seq.finish_reason is None:
                seq.finish_reason = "abort"
        group.status = SequenceStatus.FINISHED
