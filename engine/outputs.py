"""What the engine returns: per request, one ``CompletionOutput`` per sample (``n`` of them). The classes have
slots: a server builds one of each per stream per step, a third faster so."""

from __future__ import annotations

from dataclasses import dataclass, field

from rnnserve.engine.state_snapshot import StateSnapshot


@dataclass(slots=True)
class TokenLogprob:
    """Log-probability of a token and the top alternatives at that position; ``rank`` (1 = most likely) is
    set for prompt tokens."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)
    rank: int | None = None


@dataclass(slots=True)
class CompletionOutput:
    """One sample. ``text``/``token_ids``/``logprobs`` are cumulative (only the delta for ``DELTA`` requests);
    ``text_delta``/``new_token_ids``/``new_logprobs`` are what this step added (for streaming); ``num_tokens``
    counts the tokens generated so far, whatever the output kind."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None
    cumulative_logprob: float
    text_delta: str = ""
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[TokenLogprob] = field(default_factory=list)
    num_tokens: int = 0
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it (vLLM's field)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    """When a request reached each stage (``time.monotonic()`` seconds; ``None`` until reached).

    ``previous_token_time`` is ``last_token_time`` before the latest token, so a consumer can observe the
    inter-token latency of each step without keeping state of its own.
    """

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    previous_token_time: float | None = None
    finished_time: float | None = None

    def copy(self) -> RequestMetrics:
        return RequestMetrics(
            self.arrival_time,
            self.first_scheduled_time,
            self.first_token_time,
            self.last_token_time,
            self.previous_token_time,
            self.finished_time,
        )


@dataclass
class TokenLatencies:
    """The token latencies one engine step observed, one entry per request that got a token (for metrics, so
    they need no per-step output): ``queue`` and ``first_token`` (arrival to first scheduling, arrival to first
    token) for requests whose first token came, ``inter_token`` (the gap since the previous token) for the rest;
    ``started``: the ids of the requests whose first token came (a server stops counting their prompts as queued).

    A steady step's requests all got their previous token at the same time, so their gaps are one value: such a
    step has ``same_inter_token_count`` of them, each ``same_inter_token``, instead of that many entries in
    ``inter_token`` (one value and a count to send to the API servers, and to observe, not a list per step)."""

    queue: list[float] = field(default_factory=list)
    first_token: list[float] = field(default_factory=list)
    inter_token: list[float] = field(default_factory=list)
    started: list[str] = field(default_factory=list)
    same_inter_token: float = 0.0
    same_inter_token_count: int = 0

    def all_inter_token(self) -> list[float]:
        """Every inter-token latency of the step, one per request, as a list."""
        return self.inter_token + [self.same_inter_token] * self.same_inter_token_count


@dataclass(slots=True)
class RequestOutput:
    """A request's progress: one :class:`CompletionOutput` per sample. ``error`` is set (and ``finished``
    true) when the engine failed this request alone; ``error_param`` too when what failed it is the request's own
    parameter (a 400 naming it), e.g. a structured output whose grammar met llguidance's limits midway.
    ``prompt_logprobs`` (when asked for) has one entry per prompt token, ``None`` for the first (nothing
    predicts it).

    ``prompt_token_ids`` is the whole sequence before the output: a ``context``'s history, then the prompt.
    ``num_cached_tokens`` of them were not prefilled (a prefix-cache hit or the ``context``'s state).
    ``final_state`` is the sample's state once it finished with ``stop`` or ``length``, for requests that asked
    for it (``return_state``), else ``None``."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    error: str | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    num_cached_tokens: int = 0
    final_state: StateSnapshot | None = None
    error_param: str | None = None


def merge_deltas(first: RequestOutput, second: RequestOutput) -> RequestOutput:
    """Two consecutive ``DELTA`` outputs of one request as one: what both steps added, the state after the
    second (a consumer that fell behind the engine catches up with one output instead of one per step)."""
    samples = [
        CompletionOutput(a.index, a.text + b.text, a.token_ids + b.token_ids, b.finish_reason,
                         a.logprobs + b.logprobs if a.logprobs is not None and b.logprobs is not None else b.logprobs,
                         b.cumulative_logprob, a.text_delta + b.text_delta, a.new_token_ids + b.new_token_ids,
                         a.new_logprobs + b.new_logprobs, b.num_tokens, b.stop_reason)  # fmt: skip
        for a, b in zip(first.outputs, second.outputs, strict=True)
    ]
    return RequestOutput(second.request_id, second.prompt, second.prompt_token_ids, samples, second.finished,
                         second.metrics, second.error, second.prompt_logprobs, second.num_cached_tokens,
                         second.final_state, second.error_param)  # fmt: skip
