"""What the engine returns: per request, one ``CompletionOutput`` per sample (``n`` of them)."""

from __future__ import annotations

from dataclasses import dataclass, field

from rnnserve.engine.state_snapshot import StateSnapshot


@dataclass
class TokenLogprob:
    """Log-probability of a token and the top alternatives at that position; ``rank`` (1 = most likely) is
    set for prompt tokens."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)
    rank: int | None = None


@dataclass
class CompletionOutput:
    """One sample. ``text``/``token_ids`` are cumulative; ``text_delta``/``new_token_ids`` are what this
    step added (for streaming)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None
    cumulative_logprob: float
    text_delta: str = ""
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[TokenLogprob] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
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


@dataclass
class RequestOutput:
    """A request's progress: one :class:`CompletionOutput` per sample. ``error`` is set (and ``finished``
    true) when the engine failed this request alone. ``prompt_logprobs`` (when asked for) has one entry per
    prompt token, ``None`` for the first (nothing predicts it).

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
