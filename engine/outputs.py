"""What the engine returns: per request, one ``CompletionOutput`` per sample (``n`` of them)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    """Log-probability of a generated token and the top alternatives at that position."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


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
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
