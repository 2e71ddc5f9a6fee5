"""Continuous batching over a fixed pool of state slots; the scheduler owns every slot's life.

A request is admitted (strict FIFO) when the pool has a free slot for each of its ``n`` samples; there is
no preemption, because a running request's memory never grows. Each step decodes every running sample whose
prompt is done and prefills prompt chunks within a token budget (a long prompt is split across steps with
its state carried in its slot). The budget is shared fairly (see :meth:`Scheduler.schedule`), so one long
prompt can neither hold back a short one's first token nor slow running streams much. After the step,
:meth:`Scheduler.postprocess` records the prefill progress, forks a completed prompt's state into its other
samples' slots, appends the sampled tokens and frees the slots of finished samples.

With a :class:`~rnnserve.engine.prefix_cache.PrefixCache`, admission resumes a request from the deepest cached
prefix of its prompt, and states are stored at prompt ends, at multiples of ``prefix_cache_interval`` and where
a prompt branches off a cached sequence (a prompt chunk that would cross one ends at it) and when a sample
finishes with ``stop`` or ``length``.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from rnnserve.engine.config import EngineConfig
from rnnserve.engine.outputs import TokenLatencies, TokenLogprob
from rnnserve.engine.prefix_cache import PrefixCache
from rnnserve.engine.sampling_params import InvalidParameterError
from rnnserve.engine.sequence import Sequence, SequenceGroup, SteadyAppend, SteadyAppendError
from rnnserve.engine.state_pool import StatePool
from rnnserve.engine.state_snapshot import StateSnapshot


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

    @property
    def all_logits(self) -> bool:
        """Whether prefill returns the logits of every token of this chunk (for prompt logprobs)."""
        return self.group.prompt_logprobs is not None


@dataclass
class SchedulerOutput:
    """One step's work: prompt chunks to prefill, samples to decode, and prompt tokens that join the decode step
    (one-token chunks, after the samples' rows)."""

    prefill: list[PrefillChunk] = field(default_factory=list)
    decode: list[Sequence] = field(default_factory=list)
    decoded_prompts: list[PrefillChunk] = field(default_factory=list)
    long_prefill: bool = False  # a prompt longer than a chunk advances while samples decode

    def groups(self) -> list[SequenceGroup]:
        """The requests this step touches, each once, decode first."""
        seen = {id(s.group): s.group for s in self.decode}
        seen.update((id(c.group), c.group) for c in self.decoded_prompts + self.prefill)
        return list(seen.values())


@dataclass
class AppendedTokens:
    """What :meth:`Scheduler.postprocess` did: the requests with an output to read (a token their caller reads
    every step, or the end of a ``FINAL_ONLY`` request's last sample) or that failed appending, each once, in
    order; the tokens appended to requests that go on; and the token latencies of those requests. ``steady``: the
    groups are a steady batch's requests (:class:`SteadyAppend`), none of which ended."""

    groups: dict[SequenceGroup, None]
    num_tokens: int
    latencies: TokenLatencies
    steady: bool = False


class QueueFullError(RuntimeError):
    """The waiting queue is at its limit; the caller should retry later."""


class Scheduler:
    """Admits waiting requests into free slots, forms each step's batches and applies their results."""

    DECODE_TIME_SMOOTHING = 0.25  # weight of the newest decode-only step in the decode-time estimate

    def __init__(
        self,
        pool: StatePool,
        vocab_size: int,
        config: EngineConfig,
        prefix_cache: PrefixCache | None = None,
        decoded_prompt_tokens: int = 0,
        settle_fed: Callable[[], None] | None = None,
    ) -> None:
        self.pool = pool
        # brings the samples' ``num_fed`` up to date (the runner counts a steady batch's fed tokens per batch)
        self.settle_fed = settle_fed or (lambda: None)
        self.prefix_cache = prefix_cache
        self.prefix_cache_interval = config.prefix_cache_interval
        self.vocab_size = vocab_size
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_num_partial_prefills = config.max_num_partial_prefills
        self.long_prefill_token_threshold = config.long_prefill_token_threshold
        self.prefill_time_share = config.prefill_time_share
        self.decoded_prompt_tokens = decoded_prompt_tokens
        self.max_waiting = config.max_waiting
        self.waiting: deque[SequenceGroup] = deque()
        self.running: dict[str, SequenceGroup] = {}
        self._decode_seconds = 0.0  # estimated time of a decode-only step
        self._prefill_balance = 0.0  # <= 0: prefill seconds still owed to the decoding requests
        self._long_balance = 0.0  # <= 0: long prompts' prefill seconds owed to every other kind of work
        # A decode-only schedule's samples, kept while no request is admitted and no sample ends or leaves, and
        # how many more schedules may return them as they are: the engine samples one token for each sample of
        # every schedule, so the one with the fewest tokens left before ``max_tokens`` drops out after that many.
        self._steady: list[Sequence] | None = None
        self._steady_schedules = 0
        # While the steady batch stays: its appending done for the whole batch, the requests of its samples (each
        # once) and theirs that read every step, and when they all got their latest token and the one before.
        # Those two times reach the requests' metrics only when something reads them (settle_token_times):
        # ``_times_unsettled`` while the metrics lag.
        self._steady_append: SteadyAppend | None = None
        self._steady_groups: list[SequenceGroup] = []
        self._steady_readers: dict[SequenceGroup, None] = {}
        self._steady_time = 0.0
        self._steady_previous_time = 0.0
        self._times_unsettled = False

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        """Samples admitted and not finished: each holds one slot until it finishes (read every step)."""
        return self.pool.num_used

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, group: SequenceGroup) -> None:
        if group.params.n > self.pool.num_slots:
            raise InvalidParameterError("n", f"n={group.params.n} exceeds the {self.pool.num_slots} state slots")
        if self.max_waiting is not None and len(self.waiting) - self._admissible() >= self.max_waiting:
            raise QueueFullError(f"waiting queue is full ({self.max_waiting} requests)")
        self.waiting.append(group)

    def _admissible(self) -> int:
        """How many requests at the head of the queue the free slots take at the next schedule: they do not
        wait for a slot, so a burst into an idle engine is not refused while slots are free."""
        free, count = self.pool.num_free, 0
        for group in self.waiting:
            free -= group.params.n
            if free < 0:
                break
            count += 1
        return count

    def schedule(self) -> SchedulerOutput:
        """Admit what fits, then pick this step's decode samples and prompt chunks.

        Every running sample whose prompt is done decodes, every step (with async scheduling, also one whose
        latest token the host has not read yet, unless that token is its last by ``max_tokens``). Prompt chunks share
        ``max_num_batched_tokens``: prompts that finish within one chunk go first (shortest first, so a short
        prompt's first token never waits for a long prompt), then the oldest prompt, then the others by
        remaining length; at most ``max_num_partial_prefills`` prompts end the step unfinished. While samples
        decode, a prompt gets at most ``long_prefill_token_threshold`` tokens per step, and a longer prompt
        only advances while prefill has taken less than ``prefill_time_share`` of the engine's time (see
        :meth:`record_step`), so running streams keep most of their rate.

        While samples decode, a prompt with at most ``decoded_prompt_tokens`` left (and no prompt logprobs
        wanted) instead feeds its next token to the decode step: where a prefill call costs more than the
        decode steps it would replace (a GPU's launch-bound prefill against a CUDA-graph replay), arrivals
        then never stall the running streams.

        The caller samples one token for every decode sample of each schedule (or fails its request). In a steady
        batch (nothing admitted, prefilling, ended or failed since) a decode-only schedule is therefore the
        previous one, until a sample reaches ``max_tokens``, and is returned without a pass over the samples.
        """
        admits = bool(self.waiting) and self.pool.num_free >= self.waiting[0].params.n
        if self._steady is not None and self._steady_schedules > 0 and not admits:
            self._steady_schedules -= 1
            return SchedulerOutput(decode=self._steady)
        out = SchedulerOutput()
        decode = out.decode
        prompts: list[SequenceGroup] = []
        fewest_left = sys.maxsize  # the fewest tokens a decoding sample may still sample, counting this step's
        for g in self.running.values():  # one pass, attributes, not properties: this runs for every sample
            if g.num_prefilled < len(g.prompt_token_ids):
                prompts.append(g)
                continue
            for s in g.seqs:  # not finished, nor one whose last token is in flight
                left = s.max_tokens - len(s.output_token_ids) - s.num_pending
                if s.finish_reason is None and left > 0:
                    decode.append(s)
                    if left < fewest_left:
                        fewest_left = left
        self._steady = decode if decode and not prompts and not admits else None
        self._end_steady_append()
        self._steady_schedules = fewest_left - 1
        if admits:
            admitted: list[SequenceGroup] = []
            free = self.pool.num_free
            while self.waiting and free >= self.waiting[0].params.n:
                admitted.append(self.waiting.popleft())
                free -= admitted[-1].params.n
            self._admit(admitted)
            prompts += [g for g in admitted if not g.prefill_done]
        if out.decode and self.decoded_prompt_tokens:
            out.decoded_prompts = [
                PrefillChunk(g, g.num_prefilled, g.num_prefilled + 1) for g in prompts if self._decodes_prompt(g)
            ]
            fed = {id(c.group) for c in out.decoded_prompts}
            prompts = [g for g in prompts if id(g) not in fed]
        if prompts:
            out.prefill, out.long_prefill = self._prefill_chunks(prompts, decoding=bool(out.decode))
        return out

    def _decodes_prompt(self, group: SequenceGroup) -> bool:
        """Whether ``group``'s next prompt token joins this step's decode batch."""
        left = len(group.prompt_token_ids) - group.num_prefilled
        return left <= self.decoded_prompt_tokens and group.prompt_logprobs is None

    def _prefill_chunks(self, prompts: list[SequenceGroup], decoding: bool) -> tuple[list[PrefillChunk], bool]:
        """The step's prompt chunks, and whether one of them is a long prompt's while samples decode."""
        budget = self.max_num_batched_tokens
        cap = min(self.long_prefill_token_threshold, budget) if decoding else budget
        long_allowed = not decoding or self._prefill_balance >= 0.0 or self._long_balance >= 0.0
        long_taken = False
        oldest = prompts[0]

        def remaining(group: SequenceGroup) -> int:
            return len(group.prompt_token_ids) - group.num_prefilled

        chunks: list[PrefillChunk] = []
        partial = 0
        for group in sorted(prompts, key=lambda g: (remaining(g) > cap, g is not oldest, remaining(g))):
            left = remaining(group)
            if budget == 0 or (left > cap and not long_allowed) or partial == self.max_num_partial_prefills:
                break
            take = self._cut_at_snapshot(group, min(left, cap, budget))
            partial += take < left
            long_taken |= decoding and left > cap
            chunks.append(PrefillChunk(group, group.num_prefilled, group.num_prefilled + take))
            budget -= take
        return chunks, long_taken

    def _cut_at_snapshot(self, group: SequenceGroup, take: int) -> int:
        """Shorten a chunk of a cacheable prompt that would cross a multiple of ``prefix_cache_interval``, or
        the point where the prompt branches off a cached sequence, so it ends there (never to zero tokens: the
        chunk starts before that point)."""
        if self.prefix_cache is None or not group.cacheable:
            return take
        boundary = (group.num_prefilled // self.prefix_cache_interval + 1) * self.prefix_cache_interval
        if group.num_prefilled < group.branch_point < boundary:
            boundary = group.branch_point
        return min(take, boundary - group.num_prefilled)

    def record_step(self, batch: SchedulerOutput, seconds: float) -> None:
        """Account a finished step's wall time to the prefill time share. A decode-only step earns prefill
        ``prefill_time_share / (1 - prefill_time_share)`` of its time (banked up to nothing: prefill never
        runs in a burst); a step with prefill spends what it took beyond a decode-only step.

        Long prompts keep a second account, against all other work: every step without a long chunk earns it
        the same fraction of its time, so short prompts arriving all the time, whose prefill keeps the first
        account in debt, cannot hold a long prompt back forever."""
        if not batch.decode or self.prefill_time_share >= 1.0:
            self._prefill_balance = self._long_balance = 0.0
            return
        earned = seconds * self.prefill_time_share / (1.0 - self.prefill_time_share)
        if not batch.prefill:
            self._decode_seconds += (seconds - self._decode_seconds) * self.DECODE_TIME_SMOOTHING
            self._prefill_balance = min(0.0, self._prefill_balance + earned)
            self._long_balance = min(0.0, self._long_balance + earned)
            return
        spent = max(0.0, seconds - self._decode_seconds)
        self._prefill_balance -= spent
        if batch.long_prefill:
            self._long_balance -= spent
        else:
            self._long_balance = min(0.0, self._long_balance + earned)

    def _admit(self, groups: list[SequenceGroup]) -> None:
        """Give requests their slots (reset together: a burst of arrivals costs one reset); each request's first
        slot starts from its context's state, or from the deepest cached prefix of its prompt (not for prompt
        logprobs, which need every prompt token's logits)."""
        now = time.monotonic()
        for group, slots in zip(groups, self.pool.allocate_many([g.params.n for g in groups]), strict=True):
            for seq, slot in zip(group.seqs, slots, strict=True):
                seq.slot = slot
                seq.init_sampling_state(self.vocab_size, self.pool.device)
            if group.initial_state is not None:
                self.pool.write_slot(slots[0], group.initial_state)
                group.initial_state = None
            elif self.prefix_cache is not None and group.cacheable and group.prompt_logprobs is None:
                group.num_prefilled = group.num_cached_tokens = self.prefix_cache.restore(
                    group.prompt_token_ids, self.pool.tensors, slots[0]
                )
                prompt = group.prompt_token_ids
                shared = self.prefix_cache.shared_length(prompt)
                if shared - group.num_prefilled >= self.prefix_cache.min_tokens and shared < len(prompt):
                    group.branch_point = shared
            group.metrics.first_scheduled_time = now
            self.running[group.request_id] = group

    def complete_prefill(self, chunks: list[PrefillChunk]) -> list[Sequence]:
        """Record prefilled chunks; fork each completed prompt into its other samples' slots. Returns the
        samples whose first token is now due (``n`` per completed prompt)."""
        ready: list[Sequence] = []
        snapshots: list[tuple[list[int], int]] = []
        for chunk in chunks:
            group = chunk.group
            group.num_prefilled = chunk.end
            first_slot = group.seqs[0].slot
            assert first_slot is not None, "a prefilling request holds its slots"
            if (
                self.prefix_cache is not None
                and group.cacheable
                and (
                    chunk.completes_prompt or chunk.end % self.prefix_cache_interval == 0
                    or chunk.end == group.branch_point
                )
            ):
                snapshots.append((group.prompt_token_ids[: chunk.end], first_slot))
            if chunk.completes_prompt:
                if len(group.seqs) > 1:
                    self.pool.copy(first_slot, [s.slot for s in group.seqs[1:]])  # type: ignore[misc]
                ready += group.seqs
        if snapshots:
            assert self.prefix_cache is not None
            self.prefix_cache.store_many(snapshots, self.pool.tensors)
        return ready

    def postprocess(
        self,
        seqs: list[Sequence],
        token_ids: list[int],
        logprobs: list[TokenLogprob | None],
        counted: bool = True,
    ) -> AppendedTokens:
        """Append each sample's new token and free the slots of samples that finished. Samples already
        finished (their request failed or was aborted since, or, with async scheduling, it finished in the step
        before) are skipped; a sample whose stop handling raises fails its request alone. ``counted``: whether
        the samples count these tokens as pending (``Sequence.num_pending``), which appending them ends.

        The steady batch's tokens (see :meth:`schedule`) are appended for the whole batch when none of them ends
        a sample (:class:`SteadyAppend`): every request then got its previous token at the same time, so each
        has the same inter-token latency, and the requests with an output are the same as the step before."""
        now = time.monotonic()
        if counted:
            for seq in seqs:
                seq.num_pending -= 1
        steady = self._steady_append
        done, raised = 0, None  # the samples whose tokens are appended already, and the error of the next one
        if steady is not None and seqs is steady.seqs and seqs is self._steady:
            try:
                if steady.append(token_ids):
                    return self._steady_appended(len(seqs), now)
            except SteadyAppendError as stopped:
                done, raised = stopped.index, stopped.error
        self.settle_token_times()  # the loop below reads and writes them
        latencies = TokenLatencies()
        inter_token = latencies.inter_token
        groups: dict[SequenceGroup, None] = {}
        appended: list[Sequence] = []
        finished_seqs: list[Sequence] = []
        failed = False
        for index, (seq, token, logprob) in enumerate(zip(seqs, token_ids, logprobs, strict=True)):
            if seq.finish_reason is not None:
                continue
            group = seq.group
            try:
                if index >= done:  # those before were appended for the batch, this one raised there
                    if index == done and raised is not None:
                        raise raised
                    seq.append_token(token, logprob)
            except Exception as err:  # noqa: BLE001 - an error in one request's handling is that request's
                self.fail(group, err)
                groups[group] = None
                failed = True
                continue
            finished = seq.finish_reason is not None
            if group.reads_every_step or (finished and group.finished):
                groups[group] = None
            appended.append(seq)
            metrics = group.metrics
            last = metrics.last_token_time
            if last != now:
                if last is None:
                    metrics.first_token_time = now
                    latencies.first_token.append(now - metrics.arrival_time)
                    latencies.started.append(group.request_id)
                    if metrics.first_scheduled_time is not None:
                        latencies.queue.append(metrics.first_scheduled_time - metrics.arrival_time)
                else:
                    inter_token.append(now - last)
                metrics.previous_token_time = last
                metrics.last_token_time = now
            if finished:
                finished_seqs.append(seq)
        if finished_seqs:
            self._save_finished(finished_seqs)
            for seq in finished_seqs:
                self._free(seq)
        if failed:  # a request that failed later in the step (another of its samples) generated nothing
            appended = [s for s in appended if s.group.error is None]
        elif seqs is self._steady and len(appended) == len(seqs) and all(map(SteadyAppend.plain, seqs)):
            self._start_steady_append(seqs, now)  # each of its requests got its latest token now
        return AppendedTokens(groups, len(appended), latencies)

    def _start_steady_append(self, seqs: list[Sequence], now: float) -> None:
        """Append the steady batch's next tokens for the whole batch (its requests' latest token came ``now``)."""
        self._steady_append = SteadyAppend(seqs)
        groups = dict.fromkeys(s.group for s in seqs)
        self._steady_groups = list(groups)
        self._steady_readers = {g: None for g in groups if g.reads_every_step}
        self._steady_time = now

    def _steady_appended(self, num_tokens: int, now: float) -> AppendedTokens:
        """The bookkeeping of a step whose tokens :class:`SteadyAppend` appended: the batch's token times (its
        requests' metrics take them when read: :meth:`settle_token_times`), and one inter-token latency per request,
        the same for all (``postprocess`` would have found them so): one value and the count of requests
        (``TokenLatencies.same_inter_token``)."""
        latencies = TokenLatencies()
        last = self._steady_time
        if now != last:
            self._steady_previous_time, self._steady_time = last, now
            self._times_unsettled = True
            latencies.same_inter_token = now - last
            latencies.same_inter_token_count = len(self._steady_groups)
        return AppendedTokens(self._steady_readers.copy(), num_tokens, latencies, steady=True)

    def settle_token_times(self) -> None:
        """Write the steady batch's latest token times into its requests' metrics (``last_token_time`` and
        ``previous_token_time``): its steps keep them once for the whole batch, and a request's metrics lag until
        this runs. The scheduler runs it before it reads them or the batch ends; a caller runs it before reading a
        request's metrics or building its output (``LLMEngine.collect``, ``abort_request``)."""
        if not self._times_unsettled:
            return
        self._times_unsettled = False
        last, previous = self._steady_time, self._steady_previous_time
        for group in self._steady_groups:
            metrics = group.metrics
            metrics.previous_token_time = previous
            metrics.last_token_time = last

    def _end_steady_append(self) -> None:
        """Stop appending for the whole batch (its samples change): its requests' metrics take their times, its
        samples' lists their tokens."""
        self.settle_token_times()
        if self._steady_append is not None:
            self._steady_append.end()
            self._steady_append = None

    def _save_finished(self, seqs: list[Sequence]) -> None:
        """Before samples that finished with ``stop`` or ``length`` free their slots: store their states in the
        prefix cache (together), and hand each to its request if it asked for it. A state has consumed the
        prompt and every output token but the last, or, when async scheduling had already queued the next step
        with this sample (which then feeds it the last token too), every output token; the copies are queued
        behind that step."""
        snapshots: list[tuple[list[int], int]] = []
        self.settle_fed()
        for seq in seqs:
            if seq.finish_reason not in ("stop", "length") or seq.slot is None:
                continue
            group = seq.group
            consumed = group.prompt_token_ids + seq.output_token_ids[: seq.num_fed]
            if self.prefix_cache is not None and group.cacheable:
                snapshots.append((consumed, seq.slot))
            if group.return_state:
                pending = seq.output_token_ids[seq.num_fed :]
                tensors, group.final_state_copied = self.pool.read_slot(seq.slot)
                group.final_state = StateSnapshot(tensors, consumed, pending)
        if snapshots:
            assert self.prefix_cache is not None
            self.prefix_cache.store_many(snapshots, self.pool.tensors)

    def _free(self, seq: Sequence) -> None:
        """Free a finished sample's slot at once; drop the request when all its samples are done."""
        self._steady = None
        self._end_steady_append()
        if seq.slot is not None:
            self.pool.free([seq.slot])
            seq.slot = None
        group = seq.group
        if group.finished and self.running.pop(group.request_id, None) is not None:
            group.metrics.finished_time = time.monotonic()

    def fail(self, group: SequenceGroup, err: BaseException) -> None:
        """End a request because processing it raised: free its slots and record the error (an
        :class:`InvalidParameterError` as the request's own, naming its parameter)."""
        if isinstance(err, InvalidParameterError):
            group.error, group.error_param = str(err), err.param
        else:
            group.error = f"{type(err).__name__}: {err}"
        self._remove(group, "error")

    def abort(self, request_id: str) -> SequenceGroup | None:
        """Remove a request in any phase and free its slots. Returns the group, or None if unknown."""
        group = self.running.get(request_id) or next((g for g in self.waiting if g.request_id == request_id), None)
        if group is not None:
            self._remove(group, "abort")
        return group

    def _remove(self, group: SequenceGroup, reason: str) -> None:
        self._steady = None
        self._end_steady_append()
        if self.running.pop(group.request_id, None) is None and group in self.waiting:
            self.waiting.remove(group)
        self.pool.free([s.slot for s in group.seqs if s.slot is not None])
        for seq in group.seqs:
            seq.slot = None
            if seq.finish_reason is None:
                seq.finish_reason = reason
        group.metrics.finished_time = time.monotonic()
