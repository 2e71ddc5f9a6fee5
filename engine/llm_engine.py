"""The engine loop: add requests, step (prefill + decode + sample), abort, report progress."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import torch

from rnnserve.engine.loader import load_model
from rnnserve.engine.model_runner import ModelRunner
from rnnserve.engine.models.base import RecurrentLM
from rnnserve.engine.outputs import RequestOutput
from rnnserve.engine.sampler import sample
from rnnserve.engine.sampling_params import InvalidParameterError, SamplingParams
from rnnserve.engine.scheduler import Scheduler
from rnnserve.engine.sequence import Sequence, SequenceGroup
from rnnserve.engine.state_pool import StatePool
from rnnserve.engine.tokenizer import Tokenizer


@dataclass
class EngineConfig:
    max_num_seqs: int | None = 64
    state_memory: int | None = None
    max_num_batched_tokens: int = 2048
    max_prompt_tokens: int | None = None
    max_waiting: int | None = None
    enforce_eager: bool = False


@dataclass
class StepStats:
    """What one ``step()`` did (for metrics)."""

    prefill_tokens: int = 0
    decode_batch_size: int = 0
    generated_tokens: int = 0
    seconds: float = 0.0


class LLMEngine:
    """Continuous-batching engine over one model and its state pool (not thread-safe: one caller)."""

    def __init__(self, model: RecurrentLM, tokenizer: Tokenizer, config: EngineConfig | None = None) -> None:
        self.config = config or EngineConfig()
        self.model = model
        self.tokenizer = tokenizer
        device = next(iter(model.parameters()), torch.empty(0)).device
        self.pool = StatePool.from_budget(
            model.state_spec(),
            max_num_seqs=self.config.max_num_seqs,
            state_memory=self.config.state_memory,
            device=device,
        )
        self.runner = ModelRunner(model, self.pool, enforce_eager=self.config.enforce_eager)
        self.scheduler = Scheduler(self.pool, self.config.max_num_batched_tokens, self.config.max_waiting)
        self.eos_token_id = tokenizer.eos_token_id
        self.last_step = StepStats()
        self.total_prefill_tokens = 0
        self._ids = itertools.count()

    @classmethod
    def from_name(
        cls, model: str, device: str = "auto", dtype: str | torch.dtype | None = None, **config: int | bool | None
    ) -> LLMEngine:
        loaded, tokenizer = load_model(model, device=device, dtype=dtype)
        return cls(loaded, tokenizer, EngineConfig(**config))  # type: ignore[arg-type]

    @property
    def device(self) -> torch.device:
        return self.pool.device

    def encode_prompt(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        """Tokenize and validate a prompt (text or token ids)."""
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, ids = None, [int(t) for t in prompt]
        if not ids:
            raise InvalidParameterError("prompt", "prompt is empty")
        vocab = self.model.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise InvalidParameterError("prompt", f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
        limit = self.config.max_prompt_tokens
        if limit is not None and len(ids) > limit:
            raise InvalidParameterError("prompt", f"prompt has {len(ids)} tokens, the limit is {limit}")
        return text, ids

    def add_request(
        self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None
    ) -> str:
        """Queue a request; returns its id. Raises InvalidParameterError or QueueFullError."""
        text, ids = self.encode_prompt(prompt)
        bad_stop = [t for t in params.stop_token_ids if t >= self.model.vocab_size]
        if bad_stop:
            raise InvalidParameterError("stop_token_ids", f"stop token id {bad_stop[0]} is outside the vocabulary")
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        group = SequenceGroup(request_id=request_id, prompt=text, prompt_token_ids=ids, params=params)
        group.seqs = [Sequence(group, i, self.tokenizer) for i in range(params.n)]
        self.scheduler.add(group)
        return request_id

    def abort_request(self, request_id: str) -> bool:
        """Abort a request in any phase; its slots are free when this returns."""
        return self.scheduler.abort(request_id) is not None

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """Run one engine iteration; return an output for every request that progressed."""
        start = time.perf_counter()
        batch = self.scheduler.schedule()
        stats = StepStats()
        to_sample: list[Sequence] = []
        logit_rows: list[torch.Tensor] = []
        if batch.decode:
            decode_logits = self.runner.decode(
                [s.last_token_id for s in batch.decode], [s.slot for s in batch.decode]  # type: ignore[misc]
            )
            to_sample += batch.decode
            logit_rows.append(decode_logits)
            stats.decode_batch_size = len(batch.decode)
        progressed = {s.group.request_id: s.group for s in batch.decode}
        if batch.prefill:
            prefill_logits = self.runner.prefill(
                [c.token_ids for c in batch.prefill], [c.group.seqs[0].slot for c in batch.prefill]  # type: ignore[misc]
            )
            for row, chunk in enumerate(batch.prefill):
                group = chunk.group
                group.num_prefilled = chunk.end
                stats.prefill_tokens += chunk.end - chunk.start
                if group.first_scheduled_time is None:
                    group.first_scheduled_time = time.monotonic()
                if not chunk.completes_prompt:
                    continue
                if len(group.seqs) > 1:
                    self.pool.copy(group.seqs[0].slot, [s.slot for s in group.seqs[1:]])  # type: ignore[arg-type]
                for seq in group.seqs:
                    seq.init_sampling_state(self.model.vocab_size, self.device)
                to_sample += group.seqs
                logit_rows.append(prefill_logits[row : row + 1].expand(len(group.seqs), -1))
                progressed[group.request_id] = group
        if to_sample:
            logits = logit_rows[0] if len(logit_rows) == 1 else torch.cat(logit_rows)  # cat would copy
            result = sample(logits, to_sample, self.eos_token_id)
            for seq, token, logprob in zip(to_sample, result.token_ids, result.logprobs, strict=True):
                seq.append_token(token, logprob, self.eos_token_id)
                if seq.finished:
                    self.scheduler.finish_sequence(seq)
            stats.generated_tokens = len(to_sample)
        self.total_prefill_tokens += stats.prefill_tokens
        stats.seconds = time.perf_counter() - start
        self.last_step = stats
        return [group.output() for group in progressed.values()]
