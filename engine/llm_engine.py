"""The engine loop: add requests, step (schedule -> run -> sample -> postprocess), abort, report load."""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import dataclasses
import gc
import itertools
import logging
import numbers
import operator
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import NoReturn, TypeVar

import torch

from rnnserve.engine.config import DEFAULT_MAX_MODEL_LEN, EngineConfig
from rnnserve.engine.loader import load_model
from rnnserve.engine.model_runner import ModelRunner
from rnnserve.engine.models.base import RecurrentLM, StateSpec
from rnnserve.engine.outputs import RequestMetrics, RequestOutput, TokenLatencies, TokenLogprob
from rnnserve.engine.prefix_cache import PrefixCache, TierUsage
from rnnserve.engine.sampler import SampledTokens, all_argmax_only, sample
from rnnserve.engine.sampling_params import InvalidParameterError, SamplingParams
from rnnserve.engine.scheduler import AppendedTokens, PrefillChunk, Scheduler, SchedulerOutput
from rnnserve.engine.sequence import Sequence, SequenceGroup
from rnnserve.engine.state_pool import StatePool
from rnnserve.engine.state_snapshot import StateSnapshot, check_snapshot_tensors, model_fingerprint
from rnnserve.engine.structured_output import CompiledGrammar, GrammarCompiler
from rnnserve.engine.tokenizer import Tokenizer
from rnnserve.kernels.cpu_extension import build_cpu_extension

T = TypeVar("T")
logger = logging.getLogger(__name__)

MIN_SNAPSHOT_TOKENS = 16  # shorter sequences are cheaper to prefill again than to keep a whole state for
# Where decode replays CUDA graphs: a 48-layer Mamba's prefill call costs ~35 ms of host launches, its decode step
# 1-12 ms however many samples it carries, so up to ~32 prompt tokens ride the decode steps for less.
DECODED_PROMPT_TOKENS = 32
# Tracked objects allocated (net of those freed) between two collections of the collector's youngest generation
# once the startup heap is frozen; Python's default, 700, is crossed again and again by the live objects of a
# few hundred requests in flight (see freeze_startup_heap).
YOUNG_GENERATION_THRESHOLD = 50_000


M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's mallopt parameters (malloc.h)
MALLOC_ENVIRONMENT = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_MAX_", "MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES")


def retain_freed_memory() -> bool:
    """Ask glibc's malloc to keep freed memory for reuse rather than hand it back to the OS: no mmap for large
    blocks, no trimming of the heap's top. ATen's CPU allocator is malloc, and a prefill's activations (tens of MB
    each) were mapped when allocated and unmapped when freed, so every prefill paid page faults on first touch:
    a [2048, 3072] fp32 GELU took 4.3 ms in a prefill and 1.5 ms with the memory kept; bf16 prefills of 2 x 2048
    tokens ran 1-16% faster (minlstm-100m, mamba-130m, mamba2-130m). The process keeps its peak heap, as a caching
    allocator does. Nothing changes where the environment already tunes malloc (``MALLOC_*_``, ``GLIBC_TUNABLES``)
    or the C library has no ``mallopt``; returns whether it applied. Called once per serving process, after
    loading: what loading freed (a checkpoint's conversions, quantization's temporaries) goes back to the OS
    first, or the process would keep it for good."""
    if any(name in os.environ for name in MALLOC_ENVIRONMENT):
        return False
    libc = ctypes.CDLL(None)
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:
        return False
    trim = getattr(libc, "malloc_trim", None)
    if trim is not None:
        trim(0)
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, 2**31 - 1))


def freeze_startup_heap() -> None:
    """Collect garbage, then move every live object into the collector's permanent generation, as vLLM does
    once its engine is up: the full collections that a busy engine triggers then scan only objects made since
    (requests), not the hundreds of thousands that importing torch and loading the model made (on the CPU, a full
    collection of a served process took 87 ms: a pause of every stream, every few hundred steps at batch 256).
    Call it once per process, after the engine is built; objects frozen here are not collected as cycles until
    the interpreter exits (they are unfrozen then, so extension modules that check for leaks at exit find none).

    It also raises the youngest generation's threshold to :data:`YOUNG_GENERATION_THRESHOLD`. A serving process
    makes almost no garbage cycles (a finished request drops its samples, which point back at it: see
    ``SequenceGroup.release_samples``), but at Python's default of
    700 the objects of the requests in flight crossed the threshold every few requests: a young collection,
    and every tenth a middle one that scanned their survivors (12% of the serving process's CPU at 256 streams,
    ~1 us per generated token in the engine). Cycles are still collected, a few hundred times less often."""
    gc.collect()
    gc.freeze()
    atexit.register(gc.unfreeze)
    gc.set_threshold(YOUNG_GENERATION_THRESHOLD, *gc.get_threshold()[1:])


def exit_process(code: int) -> NoReturn:
    """End this process with ``code`` as the interpreter's own exit begins (Python threads that are not daemons
    joined, ``atexit`` handlers run: logging flushed, multiprocessing's finalizers, temporary folders), then
    flush the standard streams and leave, skipping the rest: tearing the modules down and the final garbage
    collections over the start-up heap that :func:`freeze_startup_heap` unfroze at exit (frozen, libtriton's
    nanobind reports its objects as leaked). Those took an idle server 2-3 s, up to 18 s on a loaded machine,
    while it held its port and its pod's termination grace. For a serving process's last call, once it has
    stopped in order; nothing after it runs."""
    # what the interpreter's exit runs first, as multiprocessing's processes do when their target returns
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken stream: nothing more can be said there
            pass
    os._exit(code)


@dataclass
class StepStats:
    """What one ``step()`` did (for metrics). ``prefix_cache_*``: requests admitted this step that looked up
    the prefix cache, those that resumed from a snapshot, and the prompt tokens they did not prefill;
    ``latencies``: the token latencies of the requests that got a token; ``device_wait_seconds``: of ``seconds``,
    the host's wait for the device's sampled tokens (with async scheduling the previous step's; 0.0 on a CPU)."""

    prefill_tokens: int = 0
    decode_batch_size: int = 0
    generated_tokens: int = 0
    seconds: float = 0.0
    device_wait_seconds: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prefix_cache_hit_tokens: int = 0
    latencies: TokenLatencies = field(default_factory=TokenLatencies)


@dataclass
class LaunchedStep:
    """A step whose model calls and sampling are queued on the device: the samples it sampled (one row each,
    ``sampled`` holds their tokens) and the requests that failed while it was launched."""

    seqs: list[Sequence] = field(default_factory=list)
    sampled: SampledTokens | None = None
    failed: list[SequenceGroup] = field(default_factory=list)
    counted: bool = True  # whether its samples count its token in ``num_pending`` (appending uncounts it)


@dataclass
class EngineLoad:
    """How full the engine is (for load gauges and health); ``prefix_cache`` has one entry per snapshot tier
    (none when the cache is off). ``num_compiling``: the requests whose structured output the server's engine
    loop compiles before adding them, counted in ``num_waiting`` too (the engine itself has none)."""

    num_running: int
    num_waiting: int
    num_slots: int
    slots_used: int
    bytes_per_slot: int
    prefix_cache: list[TierUsage] = field(default_factory=list)
    num_compiling: int = 0


class LLMEngine:
    """Continuous-batching engine over one model and its state pool (not thread-safe: one caller)."""

    def __init__(self, model: RecurrentLM, tokenizer: Tokenizer, config: EngineConfig | None = None) -> None:
        self.config = config or EngineConfig()
        self._answer_entries: int | None = None  # logprob entries of the answer being added (one_answer)
        self.model = model
        self.tokenizer = tokenizer
        device = next(iter(model.parameters()), torch.empty(0)).device
        if device.type == "cpu":
            build_cpu_extension()  # build the fused CPU kernels now, never inside a request
        self.pool = StatePool.from_budget(
            model.state_spec(),
            max_num_seqs=self.config.max_num_seqs,
            state_memory=self.config.state_memory,
            device=device,
        )
        self.runner = ModelRunner(model, self.pool, enforce_eager=self.config.enforce_eager)
        self.prefix_cache: PrefixCache | None = None
        if self.config.enable_prefix_cache:
            self.prefix_cache = PrefixCache(
                self.pool.specs,
                device,
                self.config.prefix_cache_memory,
                self.config.prefix_cache_host_memory,
                min_tokens=min(MIN_SNAPSHOT_TOKENS, self.config.prefix_cache_interval),
            )
        decoded_prompt_tokens = self.config.decoded_prompt_tokens
        if decoded_prompt_tokens is None:
            decoded_prompt_tokens = DECODED_PROMPT_TOKENS if self.runner.graphs is not None else 0
        self.scheduler = Scheduler(self.pool, model.vocab_size, self.config, self.prefix_cache, decoded_prompt_tokens,
                                   self.runner.settle_fed)  # fmt: skip
        self.max_model_len, self.max_prompt_tokens = self._length_limits()
        self.model_fingerprint = model_fingerprint(model, self.pool.specs)
        self.grammars = GrammarCompiler(tokenizer, model.vocab_size)
        self.async_scheduling = self.config.async_scheduling == "on" or (
            self.config.async_scheduling == "auto" and device.type == "cuda"
        )
        self._in_flight: LaunchedStep | None = None  # with async scheduling: the step queued before this one
        self._argmax_batch: list[Sequence] | None = None  # the latest batch sampled, when all by argmax alone
        self._uncollected: dict[SequenceGroup, None] = {}  # requests with an output from steps run with collect=False
        # whether those all go on, each with its samples (a steady batch's: collect need not look at each)
        self._uncollected_ongoing = True
        self.last_step = StepStats()
        self.total_prefill_tokens = 0
        self._ids = itertools.count()

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLMEngine:
        """Load ``config.model`` (the embedded default model when ``None``) and build the engine."""
        model, tokenizer = load_model(config.model, device=config.device, dtype=config.dtype)
        if config.quantize is not None:
            from rnnserve.engine.quantize import quantize_model

            quantize_model(model, config.quantize)
        return cls(model, tokenizer, config)

    def _length_limits(self) -> tuple[int, int]:
        """``(max_model_len, max_prompt_tokens)``: the configured values, else the model's limit (or
        ``DEFAULT_MAX_MODEL_LEN``) and ``max_model_len``."""
        model_limit = self.model.max_model_len
        limit = self.config.max_model_len or model_limit or DEFAULT_MAX_MODEL_LEN
        if model_limit is not None and limit > model_limit:
            raise ValueError(f"max_model_len {limit} exceeds the model's limit of {model_limit} tokens")
        prompt_limit = self.config.max_prompt_tokens or limit
        if prompt_limit > limit:
            raise ValueError(f"max_prompt_tokens {prompt_limit} exceeds max_model_len {limit}")
        return limit, prompt_limit

    @property
    def device(self) -> torch.device:
        return self.pool.device

    @property
    def state_specs(self) -> list[StateSpec]:
        """The per-slot state tensors of the pool (what a :class:`StateSnapshot` must match)."""
        return self.pool.specs

    def load(self) -> EngineLoad:
        return EngineLoad(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            num_slots=self.pool.num_slots,
            slots_used=self.pool.num_used,
            bytes_per_slot=self.pool.bytes_per_slot,
            prefix_cache=self.prefix_cache.usage() if self.prefix_cache is not None else [],
        )

    def encode_prompt(self, prompt: str | list[int], allow_empty: bool = False) -> tuple[str | None, list[int]]:
        """Tokenize and validate a prompt (text, or token ids that the model and the tokenizer both know); an
        empty prompt is a 400 unless ``allow_empty``."""
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt)
            top = max(ids, default=0)
            if top >= self.model.vocab_size:  # a tokenizer larger than the model's vocabulary
                raise InvalidParameterError(
                    "prompt", f"the tokenizer gave token id {top}, outside the model's vocabulary "
                    f"[0, {self.model.vocab_size})"
                )
        else:
            bad = next((t for t in prompt if not isinstance(t, numbers.Integral) or isinstance(t, bool)), None)
            if bad is not None:  # 72.5 was read as 72, True as 1
                raise InvalidParameterError("prompt", f"token ids must be integers, got {bad!r}")
            text, ids = None, [int(t) for t in prompt]
            vocab = self.model.vocab_size
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise InvalidParameterError("prompt", f"token id {bad} is outside the vocabulary [0, {vocab})")
            bad = self.tokenizer.first_undecodable(ids)
            if bad is not None:
                raise InvalidParameterError("prompt", f"token id {bad} is not in the tokenizer's vocabulary")
        if not ids and not allow_empty:
            raise InvalidParameterError("prompt", "prompt is empty")
        if len(ids) > self.max_prompt_tokens:
            raise InvalidParameterError(
                "prompt", f"prompt has {len(ids)} tokens, the limit is {self.max_prompt_tokens}"
            )
        return text, ids

    def fit_max_tokens(self, num_prompt_tokens: int, params: SamplingParams) -> SamplingParams:
        """``params`` with ``max_tokens`` cut to the room the prompt leaves under ``max_model_len`` when they ask
        for it (``fit_max_tokens``) and there is room; else ``params`` as they are."""
        room = self.max_model_len - num_prompt_tokens
        if not params.fit_max_tokens or params.max_tokens <= room or room < 1:
            return params
        return dataclasses.replace(params, max_tokens=room, min_tokens=min(params.min_tokens, room))

    def check_limits(self, num_prompt_tokens: int, params: SamplingParams, prompt: str = "prompt") -> None:
        """Raise InvalidParameterError (a 400) for a request beyond the engine's length or stop-string limits;
        ``prompt`` names what the ``num_prompt_tokens`` are (``context + prompt`` when a request continues a
        state: a session's 1-token turn was told its prompt had the whole history's length)."""
        if params.fit_max_tokens and num_prompt_tokens >= self.max_model_len:
            raise InvalidParameterError(
                "prompt",
                f"the {prompt} ({num_prompt_tokens} tokens) leaves no room for a token under the "
                f"{self.max_model_len}-token limit (max_model_len)",
            )
        if num_prompt_tokens + params.max_tokens > self.max_model_len:
            raise InvalidParameterError(
                "max_tokens",
                f"{prompt} ({num_prompt_tokens} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                f"{self.max_model_len}-token limit (max_model_len)",
            )
        if len(params.stop) > self.config.max_stop_sequences:
            raise InvalidParameterError("stop", f"at most {self.config.max_stop_sequences} stop strings")
        longest = max(map(len, params.stop), default=0)
        if longest > self.config.max_stop_length:
            raise InvalidParameterError(
                "stop", f"a stop string has {longest} characters, the limit is {self.config.max_stop_length}"
            )

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        arrival_time: float | None = None,
        *,
        context: StateSnapshot | None = None,
        return_state: bool = False,
        grammar: CompiledGrammar | None = None,
    ) -> str:
        """Queue a request; returns its id. Raises InvalidParameterError (a 400) or QueueFullError (a 429).

        With ``context`` the request continues that state: its sequence is ``context.token_ids +
        context.pending_token_ids`` + the prompt (which may be empty when tokens are pending), and only the
        pending tokens and the prompt are prefilled. With ``return_state`` (``n == 1`` only) the output
        carries the sample's state in ``final_state`` once it finishes with ``stop`` or ``length`` (on CUDA,
        in pinned memory, and that output may come a few steps later: see :meth:`collect`). ``grammar`` is
        ``params.structured_outputs`` compiled already (:attr:`grammars`; the server compiles it off this thread),
        else it is compiled here.
        """
        text, ids = self.encode_prompt(prompt, allow_empty=context is not None and bool(context.pending_token_ids))
        num_consumed = 0
        if context is not None:
            ids = self._context_token_ids(context) + ids
            num_consumed = len(context.token_ids)
            if len(ids) > self.max_prompt_tokens:
                raise InvalidParameterError(
                    "prompt", f"context + prompt have {len(ids)} tokens, the limit is {self.max_prompt_tokens}"
                )
            if params.prompt_logprobs is not None:
                raise InvalidParameterError("prompt_logprobs", "prompt_logprobs cannot be combined with a context")
        if return_state and params.n != 1:
            raise InvalidParameterError("n", f"returning the state needs n=1, got n={params.n}")
        self._check_token_params(params)
        params = self.fit_max_tokens(len(ids), params)
        self.check_limits(len(ids), params, "context + prompt" if context is not None else "prompt")
        answer_entries = self._check_logprob_entries(len(ids), params)
        self.model.check_request(len(ids), params.max_tokens)
        if grammar is None and params.structured_outputs is not None:
            grammar = self.grammars.compile(params.structured_outputs)
        if grammar is not None and params.allowed_token_ids is not None and not grammar.allows_first(
            params.allowed_token_ids
        ):
            raise InvalidParameterError(
                "allowed_token_ids", "allowed_token_ids leave no token the structured output allows first"
            )
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        metrics = RequestMetrics(arrival_time if arrival_time is not None else time.monotonic())
        group = SequenceGroup(request_id, text, ids, params, metrics, return_state=return_state, grammar=grammar)
        if context is not None:
            group.from_context = True
            group.initial_state = context.tensors
            group.num_prefilled = group.num_cached_tokens = num_consumed
        group.seqs = [Sequence(group, i, self.tokenizer) for i in range(params.n)]
        try:
            self.scheduler.add(group)
        except BaseException:  # refused (a full queue: a 429): its samples point back at it, a cycle to break
            group.release_samples()
            raise
        if self._answer_entries is not None:
            self._answer_entries = answer_entries
        return request_id

    @contextlib.contextmanager
    def one_answer(self) -> Iterator[None]:
        """The requests added inside are the prompts of one answer (one API request): their logprob entries count
        together against ``max_logprob_entries``."""
        self._answer_entries = 0
        try:
            yield
        finally:
            self._answer_entries = None

    def _check_logprob_entries(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        """The logprob entries of the answer so far with this prompt's (per sample: each prompt token's with its
        ``prompt_logprobs`` alternatives, each generated token's with its ``logprobs`` ones); InvalidParameterError
        past ``max_logprob_entries``: a response body built from them (prompt logprobs repeated in each choice)
        could take gigabytes for a request of kilobytes."""
        per_sample = 0
        if params.prompt_logprobs is not None:
            per_sample += num_prompt_tokens * (params.prompt_logprobs + 1)
        if params.logprobs is not None:
            per_sample += params.max_tokens * (params.logprobs + 1)
        entries = (self._answer_entries or 0) + params.n * per_sample
        limit = self.config.max_logprob_entries
        if limit is not None and entries > limit:
            param = "logprobs" if params.logprobs is not None else "prompt_logprobs"
            raise InvalidParameterError(
                param,
                f"the answer would carry {entries} logprob entries (samples x tokens x (alternatives + 1), "
                f"prompts included), the limit is {limit} (max_logprob_entries); ask for fewer alternatives, "
                "tokens or samples",
            )
        return entries

    def _check_token_params(self, params: SamplingParams) -> None:
        """The token ids in ``params`` are in the vocabulary, and ``allowed_token_ids`` leaves a token to sample
        while ``min_tokens`` forbids the stop tokens."""
        vocab = self.model.vocab_size
        for param, tokens in (
            ("stop_token_ids", params.stop_token_ids),
            ("logit_bias", params.logit_bias or ()),
            ("allowed_token_ids", params.allowed_token_ids or ()),
        ):
            bad = next((t for t in tokens if t >= vocab), None)
            if bad is not None:
                raise InvalidParameterError(param, f"token id {bad} in {param} is outside the vocabulary [0, {vocab})")
        favoured = [t for t, bias in (params.logit_bias or {}).items() if bias > 0]
        for param, tokens in (("allowed_token_ids", params.allowed_token_ids), ("logit_bias", favoured)):
            bad = self.tokenizer.first_undecodable(tokens) if tokens else None
            if bad is not None:  # a model's padding rows past its tokenizer: samples of nothing but empty text
                raise InvalidParameterError(param, f"token id {bad} in {param} is not in the tokenizer's vocabulary")
        if params.allowed_token_ids is not None and params.min_tokens:
            banned = set(params.stop_token_ids) | (set() if params.ignore_eos else self.tokenizer.eos_token_ids)
            if banned.issuperset(params.allowed_token_ids):
                raise InvalidParameterError(
                    "allowed_token_ids", "allowed_token_ids holds only stop tokens, which min_tokens forbids"
                )

    def _context_token_ids(self, context: StateSnapshot) -> list[int]:
        """Validate a context (its state against the pool's specs, its tokens against the vocabulary) and
        return its history tokens."""
        check_snapshot_tensors(context.tensors, self.pool.specs)
        vocab = self.model.vocab_size
        history = []
        for token in context.history_token_ids:
            try:
                history.append(operator.index(token))
            except TypeError:
                raise InvalidParameterError("context", f"context token id {token!r} is not an integer") from None
            if not 0 <= history[-1] < vocab:
                raise InvalidParameterError("context", f"context token {token} is outside the vocabulary [0, {vocab})")
        return history

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Abort a request in any phase; its slots are free when this returns. Returns its final output, or
        ``None`` for an unknown (or already finished) request."""
        group = self.scheduler.abort(request_id)
        if group is None:
            return None
        self._uncollected.pop(group, None)
        output = group.output()
        group.release_samples()
        return output

    def step(self, collect: bool = True) -> list[RequestOutput]:
        """Run one engine iteration; return an output for every request that progressed (and whose
        ``output_kind`` wants one now) or failed, since this step or the steps before it run with ``collect``
        false: those return nothing and leave their outputs to the next collection (:meth:`collect_outputs`).
        A consumer that falls behind the engine so has each request's progress over several steps built once
        (``DELTA`` outputs hold what the steps added together), instead of one output per step.

        Synchronously, a step schedules, runs the model, samples and appends the tokens. With async scheduling
        (on CUDA by default) a step queues its model calls and sampling on the device, then processes the
        previous step's tokens while the device computes: its outputs are that step's. The samples of the
        previous step are in the queued one although the host does not know yet whether they finished; one
        that did loses the token sampled for it, and its slot, already free, is written once more (its saved
        state then includes its last token: see ``Scheduler._save_finished``).

        A failure while running, sampling or post-processing fails only the requests it concerns: those of
        the batch whose model call raised (their states may be half-written), or the one request whose
        sampling or stop handling raised.
        """
        start = time.perf_counter()
        queries, hits, hit_tokens = self._prefix_cache_lookups()
        batch = self.scheduler.schedule()
        queries_after, hits_after, hit_tokens_after = self._prefix_cache_lookups()
        stats = StepStats(
            decode_batch_size=len(batch.decode),
            prefix_cache_queries=queries_after - queries,
            prefix_cache_hits=hits_after - hits,
            prefix_cache_hit_tokens=hit_tokens_after - hit_tokens,
        )
        launched = self._launch(batch, stats)
        if self.async_scheduling:
            done, self._in_flight = self._in_flight, launched if launched.sampled is not None else None
        else:
            done = launched
        if done is not None:
            appended = self._complete(done, stats)
            if self._uncollected_ongoing and appended.steady and appended.groups:
                # the steady batch's requests, in its order (a collection may have left some of them: a subset)
                self._uncollected = appended.groups
            else:
                self._uncollected.update(appended.groups)
                self._uncollected_ongoing &= appended.steady
        if launched.failed:
            self._uncollected.update(dict.fromkeys(launched.failed))
            self._uncollected_ongoing = False
        self.total_prefill_tokens += stats.prefill_tokens
        stats.seconds = time.perf_counter() - start
        self.scheduler.record_step(batch, stats.seconds)
        self.last_step = stats
        return self.collect_outputs() if collect else []

    @property
    def eos_token_id(self) -> int | None:
        """The tokenizer's EOS id (each sample reads it when it is created)."""
        return self.tokenizer.eos_token_id

    @property
    def has_uncollected_outputs(self) -> bool:
        """Whether a step run with ``collect`` false left outputs for :meth:`collect_outputs`."""
        return bool(self._uncollected)

    def collect_outputs(self) -> list[RequestOutput]:
        """The outputs of the requests that progressed or failed since the last collection (see :meth:`step`)."""
        return self.collect(SequenceGroup.output)

    def collect(
        self,
        build: Callable[[SequenceGroup], T],
        wanted: Callable[[SequenceGroup], bool] | None = None,
        bulk: Callable[[list[SequenceGroup], Callable[[SequenceGroup], bool] | None], list[SequenceGroup]]
        | None = None,
    ) -> list[T]:
        """:meth:`collect_outputs` with each output built by ``build(request)`` (``SequenceGroup.output`` there;
        the engine process builds the plain rows it sends), of the requests ``wanted`` accepts (all by default):
        the others keep their progress for a later collection (an engine process's API server that has not
        handled its earlier outputs yet gets its requests' outputs later, merged).

        ``bulk``, when given, sees the requests to collect first, all together: it builds the outputs it takes in
        one pass (the engine process's columns of stream deltas, ``OutputEncoder.take_deltas``), which it keeps
        itself, and returns the requests it left. It takes unfinished requests only. When the requests are a steady
        batch's only, it sees them all, with ``wanted``, and takes the outputs of those ``wanted`` accepts only
        (the engine process's stream plan takes those of each API server with room in one pass); those it returns
        that ``wanted`` accepts are left to ``build``, the others wait.

        A finished request whose ``final_state`` is still on its way to the host (CUDA) waits for a later
        collection while other requests keep the engine stepping, so that no step waits for the copy; once
        none do, the collection waits for it."""
        groups, self._uncollected = self._uncollected, {}
        ongoing, self._uncollected_ongoing = self._uncollected_ongoing, True
        ready: list[SequenceGroup] = []
        busy: bool | None = None
        if ongoing and (wanted is None or bulk is not None):
            # only steady steps' requests: each has its samples, none has a final state
            return self._build_outputs(self._collect_ongoing(list(groups), wanted, bulk), build)
        for group in groups:
            if not group.seqs:  # finished, its final output built in an earlier collection
                continue
            if wanted is not None and not wanted(group):
                self._uncollected[group] = None
                continue
            copied = group.final_state_copied
            if copied is not None:
                if not copied.query():
                    if busy is None:
                        busy = self.has_unfinished_requests()
                    if busy:
                        self._uncollected[group] = None
                        continue
                    copied.synchronize()
                group.final_state_copied = None
            ready.append(group)
        if self._uncollected:
            self._uncollected_ongoing = False
        if bulk is not None:
            ready = bulk(ready, None)
        return self._build_outputs(ready, build)

    def _collect_ongoing(
        self,
        groups: list[SequenceGroup],
        wanted: Callable[[SequenceGroup], bool] | None,
        bulk: Callable[[list[SequenceGroup], Callable[[SequenceGroup], bool] | None], list[SequenceGroup]] | None,
    ) -> list[SequenceGroup]:
        """The requests of steady steps to build outputs of (``bulk`` took its own first); those that ``wanted``
        refuses stay uncollected, ongoing still."""
        ready = bulk(groups, wanted) if bulk is not None else groups
        if wanted is None:
            return ready
        waiting = self._uncollected
        built = []
        for group in ready:
            if wanted(group):
                built.append(group)
            else:
                waiting[group] = None
        return built

    def _build_outputs(self, ready: list[SequenceGroup], build: Callable[[SequenceGroup], T]) -> list[T]:
        """Build the outputs of the requests ``ready``, after their token times settle; one whose building raises
        fails alone."""
        if ready:  # their outputs carry their metrics
            self.scheduler.settle_token_times()
        outputs = []
        for group in ready:
            try:
                output = build(group)
            except Exception as err:  # noqa: BLE001 - e.g. a tokenizer raising on the text: that request's failure
                logger.exception("building the output of request %s failed", group.request_id)
                self.scheduler.fail(group, err)
                for seq in group.seqs:
                    seq.abandon_text()
                output = build(group)
            outputs.append(output)
            if group.finished:
                group.release_samples()
        return outputs

    def _launch(self, batch: SchedulerOutput, stats: StepStats) -> LaunchedStep:
        """Run the batch's model calls and sample its rows, without waiting for the device."""
        launched = LaunchedStep()
        launched.seqs, logits = self._run(batch, stats, launched.failed)
        if launched.seqs:
            slots = self.runner.slot_tensor(launched.seqs)  # before sampling: a request failing there frees its slots
            launched.sampled = self._sample(logits, launched.seqs, launched.failed)
            self.runner.record_sampled(slots, launched.sampled.tokens)
            self._count_pending(launched)
        return launched

    def _count_pending(self, launched: LaunchedStep) -> None:
        """Count the launched step's token as pending in each of its samples, read before the host appends it
        (the scheduler's limits, ``min_tokens``, grammars). Synchronously nothing reads it before its step appends
        it, so nothing counts it; a step of the same samples as the step in flight (a steady batch) takes over the
        count of that step, whose appending then leaves it: each sample keeps one token pending, and no pass over
        the batch adds one and takes it off again."""
        in_flight = self._in_flight
        if not self.async_scheduling:
            launched.counted = False
        elif in_flight is not None and in_flight.counted and launched.seqs is in_flight.seqs:
            in_flight.counted = False
        else:
            for seq in launched.seqs:
                seq.num_pending += 1

    def _complete(self, launched: LaunchedStep, stats: StepStats) -> AppendedTokens:
        """Wait for a launched step's tokens and append them; returns what appending did, with the requests that
        got a token (or failed while appending it). Requests that failed while the step was launched were reported
        then."""
        if launched.sampled is None:
            return AppendedTokens({}, 0, TokenLatencies(), steady=True)
        token_ids, logprobs = launched.sampled.result()
        stats.device_wait_seconds = launched.sampled.device_wait
        appended = self.scheduler.postprocess(launched.seqs, token_ids, logprobs, launched.counted)
        stats.latencies = appended.latencies
        stats.generated_tokens = appended.num_tokens
        return appended

    def has_unfinished_requests(self) -> bool:
        """Whether a request waits, runs, or has a token in flight (async scheduling)."""
        if self.scheduler.has_unfinished():
            return True
        return self._in_flight is not None and any(s.finish_reason is None for s in self._in_flight.seqs)

    def _prefix_cache_lookups(self) -> tuple[int, int, int]:
        """The prefix cache's cumulative lookups, hits and tokens the hits skipped (zeros when it is off)."""
        if self.prefix_cache is None:
            return 0, 0, 0
        stats = self.prefix_cache.stats
        return stats.queries, stats.hits, stats.hit_tokens

    def _run(
        self, batch: SchedulerOutput, stats: StepStats, failed: list[SequenceGroup]
    ) -> tuple[list[Sequence], torch.Tensor]:
        """Decode, then prefill; returns the samples to sample now and their logits rows. Requests whose model
        call raised are failed and added to ``failed``."""
        seqs: list[Sequence] = []
        rows: list[torch.Tensor] = []
        if batch.decode or batch.decoded_prompts:
            try:
                logits = self.runner.decode(batch.decode, batch.decoded_prompts)
            except Exception as err:  # noqa: BLE001
                groups = [s.group for s in batch.decode] + [c.group for c in batch.decoded_prompts]
                failed += self._fail_groups({g.request_id: g for g in groups}.values(), err)
            else:
                rows.append(logits[: len(batch.decode)])
                # the decode list itself while nothing joins it: a steady batch's appending recognises it
                seqs = batch.decode
                if batch.decoded_prompts:
                    stats.prefill_tokens += len(batch.decoded_prompts)
                    seqs = seqs + self.scheduler.complete_prefill(batch.decoded_prompts)
                for row, chunk in enumerate(batch.decoded_prompts, len(batch.decode)):
                    if chunk.completes_prompt:  # the prompt's last token: its logits give the first output token
                        rows.append(logits[row : row + 1].expand(len(chunk.group.seqs), -1))
        if batch.prefill:
            try:
                prefill_logits = self.runner.prefill(batch.prefill)
            except Exception as err:  # noqa: BLE001
                failed += self._fail_groups([c.group for c in batch.prefill], err)
            else:
                stats.prefill_tokens += sum(c.end - c.start for c in batch.prefill)
                chunks = self._record_prompt_logprobs(batch.prefill, prefill_logits, failed)
                ready = self.scheduler.complete_prefill([c for c, _ in chunks])
                for chunk, logits in chunks:
                    if chunk.completes_prompt:
                        rows.append(logits[-1:].expand(len(chunk.group.seqs), -1))
                seqs = seqs + ready
        if not seqs:
            return [], torch.empty(0)
        return seqs, rows[0] if len(rows) == 1 else torch.cat(rows)

    def _record_prompt_logprobs(
        self, chunks: list[PrefillChunk], logits: list[torch.Tensor], failed: list[SequenceGroup]
    ) -> list[tuple[PrefillChunk, torch.Tensor]]:
        """Accumulate the prompt logprobs of the chunks that want them; a request whose logprobs fail fails
        alone. Returns the chunks (with their logits) whose requests go on."""
        kept = []
        for chunk, rows in zip(chunks, logits, strict=True):
            try:
                chunk.group.record_prompt_logprobs(chunk.start, rows)
            except Exception as err:  # noqa: BLE001 - an error in one request's handling is that request's
                failed += self._fail_groups([chunk.group], err)
                continue
            kept.append((chunk, rows))
        return kept

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence], failed: list[SequenceGroup]) -> SampledTokens:
        """Sample the whole batch; if that raises, sample row by row (waiting for each) and fail only the
        requests whose rows raise (added to ``failed``)."""
        if seqs != self._argmax_batch:  # a steady batch's samples are checked once
            self._argmax_batch = list(seqs) if all_argmax_only(seqs) else None
        try:
            return sample(logits, seqs, self._argmax_batch is not None)
        except Exception:  # noqa: BLE001
            logger.warning("batched sampling failed; retrying row by row to isolate the request", exc_info=True)
        token_ids: list[int] = []
        logprobs: list[TokenLogprob | None] = []
        for row, seq in enumerate(seqs):
            try:
                one = sample(logits[row : row + 1], [seq]).result()
            except Exception as err:  # noqa: BLE001
                if seq.group.error is None:
                    failed += self._fail_groups([seq.group], err)
                one = ([0], [None])
            token_ids += one[0]
            logprobs += one[1]
        return SampledTokens.from_host(token_ids, logprobs, logits.device)

    def _fail_groups(self, groups: Iterable[SequenceGroup], err: BaseException) -> list[SequenceGroup]:
        """Fail the requests (freeing their slots); returns them."""
        groups = list(groups)
        for group in groups:
            logger.error("request %s failed: %s: %s", group.request_id, type(err).__name__, err, exc_info=err)
            self.scheduler.fail(group, err)
        return groups
