"""Per-request sampling parameters (OpenAI / vLLM names and meanings)."""

from __future__ import annotations

from dataclasses import dataclass, field


class InvalidParameterError(ValueError):
    """A request parameter is out of range; ``param`` names it (for OpenAI-style 400 errors)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    """How to sample one request.

    ``temperature == 0`` is greedy. ``top_k <= 0`` and ``top_p == 1`` disable those filters. Penalties
    follow OpenAI (presence/frequency, over generated tokens) and vLLM (repetition, over prompt and
    generated tokens). ``seed`` makes the request's samples independent of the rest of the batch.
    ``logprobs = N`` returns the sampled token's log-probability and the top ``N`` alternatives.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    max_tokens: int = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None

    MAX_LOGPROBS = 20

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in self.stop if s]
        self.validate()

    def validate(self) -> None:
        """Raise :class:`InvalidParameterError` for any out-of-range value."""
        checks = [
            ("n", 1 <= self.n <= 128, "n must be between 1 and 128"),
            ("temperature", 0.0 <= self.temperature <= 100.0, "temperature must be between 0 and 100"),
            ("top_p", 0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]"),
            ("top_k", self.top_k >= -1, "top_k must be -1, 0 (disabled) or a positive integer"),
            ("min_p", 0.0 <= self.min_p <= 1.0, "min_p must be in [0, 1]"),
            ("repetition_penalty", 0.0 < self.repetition_penalty <= 10.0, "repetition_penalty must be in (0, 10]"),
            ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0, "presence_penalty must be in [-2, 2]"),
            ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty must be in [-2, 2]"),
            ("max_tokens", self.max_tokens >= 1, "max_tokens must be at least 1"),
            ("min_tokens", 0 <= self.min_tokens <= self.max_tokens, "min_tokens must be in [0, max_tokens]"),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= self.MAX_LOGPROBS,
             f"logprobs must be between 0 and {self.MAX_LOGPROBS}"),
            ("stop", len(self.stop) <= 16, "at most 16 stop strings"),
            ("stop_token_ids", all(t >= 0 for t in self.stop_token_ids), "stop_token_ids must be non-negative"),
        ]
        for param, ok, message in checks:
            if not ok:
                raise InvalidParameterError(param, message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
