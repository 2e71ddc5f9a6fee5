"""Per-request sampling parameters (OpenAI / vLLM names and meanings)."""

from __future__ import annotations

import enum
import json
import math
import numbers
from dataclasses import dataclass, field
from typing import Any

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
INT_FIELDS = ("n", "top_k", "max_tokens", "min_tokens")
STRUCTURED_OUTPUT_KINDS = ("json", "json_object", "regex", "choice", "grammar")
FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")


class OutputKind(enum.Enum):
    """Which outputs a request's caller consumes (vLLM's ``RequestOutputKind``): every step's progress with
    the whole text so far (``CUMULATIVE``), every step's progress with only what it added (``DELTA``, for
    streaming), or one output when the request finishes (``FINAL_ONLY``). The engine builds no more than that."""

    CUMULATIVE = "cumulative"
    DELTA = "delta"
    FINAL_ONLY = "final_only"


class InvalidParameterError(ValueError):
    """A request parameter is out of range; ``param`` names it (for OpenAI-style 400 errors)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param

    def __reduce__(self) -> tuple[type, tuple[str, str]]:  # pickled whole (it crosses to the server process)
        return type(self), (self.param, str(self))


def as_number(param: str, value: object, integer: bool) -> int | float:
    """``value`` as an ``int`` (``integer``) or a finite ``float``; :class:`InvalidParameterError` for anything
    else: bools, strings, floats where an integer is expected, NaN, infinities, ints beyond the float range."""
    if type(value) is int and integer:  # the common cases first: every request checks about fifteen fields
        return value
    if type(value) is float and not integer and math.isfinite(value):
        return value
    kind = numbers.Integral if integer else numbers.Real
    if isinstance(value, bool) or not isinstance(value, kind):
        raise InvalidParameterError(param, f"{param} must be {'an integer' if integer else 'a number'}")
    if integer:
        return int(value)  # type: ignore[call-overload]
    try:
        number = float(value)  # type: ignore[arg-type]
    except OverflowError:
        number = math.inf
    if not math.isfinite(number):
        raise InvalidParameterError(param, f"{param} must be a finite number")
    return number


@dataclass(frozen=True)
class StructuredOutputParams:
    """One constraint (vLLM's ``structured_outputs`` names): ``json`` a JSON schema (a dict or its text),
    ``json_object`` any JSON object, ``regex`` a regular expression (Rust ``regex`` syntax), ``choice`` one of
    the strings, ``grammar`` a Lark grammar in llguidance's dialect. JSON is written compactly (``", "`` and
    ``": "`` between items, as Python's ``json.dumps``; a schema's ``x-guidance`` options override that) unless
    ``disable_any_whitespace`` is false, which allows any whitespace between tokens (vLLM's default).
    ``param`` is the request field that errors name (``response_format`` where OpenAI's field asked for it)."""

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = True
    param: str = "structured_outputs"

    def __post_init__(self) -> None:
        given = [kind for kind in STRUCTURED_OUTPUT_KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            kinds = ", ".join(STRUCTURED_OUTPUT_KINDS)
            raise InvalidParameterError(self.param, f"give exactly one of {kinds} (got {', '.join(given) or 'none'})")
        choice = self.choice
        valid_choice = isinstance(choice, list) and choice and all(isinstance(c, str) and c for c in choice)
        if choice is not None and not valid_choice:
            raise InvalidParameterError(self.param, "choice must be a non-empty list of non-empty strings")
        for kind in ("regex", "grammar"):
            value = getattr(self, kind)
            if value is not None and not (isinstance(value, str) and value):
                raise InvalidParameterError(self.param, f"{kind} must be a non-empty string")
        if self.json is not None and not isinstance(self.json, dict | str):
            raise InvalidParameterError(self.param, "json must be a JSON schema (an object)")
        if isinstance(self.json, dict):
            try:  # a NaN, an Infinity or 1e400 in a schema came out as null in the generated JSON
                json.dumps(self.json, allow_nan=False)
            except (ValueError, TypeError, RecursionError) as err:  # RecursionError: nested past Python's stack
                raise InvalidParameterError(self.param, f"the JSON schema is not JSON: {err}") from None

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> StructuredOutputParams:
        """vLLM's ``structured_outputs`` dict (``{"choice": [...]}``, ...), its keys and flags checked."""
        param = "structured_outputs"
        unknown = sorted(set(options) - {*STRUCTURED_OUTPUT_KINDS, "disable_any_whitespace"})
        if unknown:
            raise InvalidParameterError(param, f"structured_outputs does not support {', '.join(unknown)}")
        for flag in ("json_object", "disable_any_whitespace"):
            if flag in options and not isinstance(options[flag], bool):
                raise InvalidParameterError(param, f"structured_outputs.{flag} must be a boolean")
        return cls(**options)


@dataclass
class SamplingParams:
    """How to sample one request.

    ``temperature`` below :attr:`GREEDY_TEMPERATURE` (0 included) is greedy, as in vLLM. ``top_k <= 0`` and
    ``top_p == 1`` disable those filters. Penalties follow OpenAI (presence/frequency, over generated tokens) and
    vLLM (repetition, over prompt and generated tokens). ``seed`` makes the request's samples independent of the
    rest of the batch. ``logprobs = N`` returns the sampled token's log-probability and the top ``N`` alternatives;
    ``prompt_logprobs = N`` (vLLM) does the same for every prompt token after the first, computed in prefill.
    ``logit_bias`` (OpenAI) adds a value, clamped into [-100, 100], to the logits of the tokens it names;
    ``allowed_token_ids`` (vLLM) restricts sampling to the tokens it lists. Both act before the penalties, and
    logprobs see them.
    ``structured_outputs`` makes every sample follow a JSON schema, regex, choice or grammar (see
    :mod:`rnnserve.engine.structured_output`).
    Every numeric field has a fixed range (integers within int64 at most), checked on construction, so no
    value can overflow in the sampler; ``top_k`` at or above the vocabulary size keeps every token.
    ``output_kind`` says which outputs the caller reads (see :class:`OutputKind`).
    ``include_stop_str_in_output`` (vLLM) keeps a stop string that ends the text in it.
    ``skip_special_tokens`` (vLLM) leaves special tokens' text (``<|im_end|>``) out of the output's text.
    ``fit_max_tokens`` makes ``max_tokens`` an upper bound: a prompt that leaves less room under the engine's
    ``max_model_len`` gets what room there is instead of a 400 (the server sets it for requests that give no
    ``max_tokens``, whose limit vLLM takes as the room the prompt leaves). ``max_tokens=None`` (vLLM's spelling of
    no limit) is that room: ``max_tokens`` becomes the largest value and ``fit_max_tokens`` true.
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
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    structured_outputs: StructuredOutputParams | None = None
    output_kind: OutputKind = OutputKind.CUMULATIVE
    fit_max_tokens: bool = False

    MAX_N = 128
    GREEDY_TEMPERATURE = 1e-5  # vLLM's _SAMPLING_EPS: below it, dividing the logits by the temperature is noise
    MAX_LOGPROBS = 20
    MAX_LOGIT_BIAS = 100.0
    MIN_REPETITION_PENALTY = 0.01  # logits are divided by it in fp32: a tiny penalty would overflow them
    SEED_RANGE = (INT64_MIN, INT64_MAX - MAX_N)  # the samples draw from seed + index: int64 throughout

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in self.stop or () if s]  # None: none, as vLLM takes it
        self.stop_token_ids = list(self.stop_token_ids or ())
        if self.max_tokens is None:
            self.max_tokens, self.fit_max_tokens = INT64_MAX, True
        self.validate()

    def validate(self) -> None:
        """Normalise numeric fields to ``int``/``float`` and raise :class:`InvalidParameterError` for a wrong
        type or an out-of-range value."""
        for name in INT_FIELDS + FLOAT_FIELDS:
            setattr(self, name, as_number(name, getattr(self, name), integer=name in INT_FIELDS))
        for name in ("seed", "logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                setattr(self, name, as_number(name, getattr(self, name), integer=True))
        self.stop_token_ids = [as_number("stop_token_ids", t, integer=True) for t in self.stop_token_ids]
        if self.logit_bias is not None:
            self.logit_bias = {
                as_number("logit_bias", token, integer=True): self.clamped_bias(bias)
                for token, bias in self.logit_bias.items()
            }
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = [as_number("allowed_token_ids", t, integer=True) for t in self.allowed_token_ids]
        if isinstance(self.structured_outputs, dict):  # vLLM's keyword spelling: {"json": schema}, {"regex": ...}
            self.structured_outputs = StructuredOutputParams.from_options(self.structured_outputs)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputParams):
            raise InvalidParameterError(
                "structured_outputs", "structured_outputs must be StructuredOutputParams or a dict of its fields"
            )
        if not all(isinstance(s, str) for s in self.stop):
            raise InvalidParameterError("stop", "stop must be a string or a list of strings")
        seed_min, seed_max = self.SEED_RANGE
        in_range = {
            "n": 1 <= self.n <= self.MAX_N,
            "temperature": 0.0 <= self.temperature <= 100.0,
            "top_p": 0.0 < self.top_p <= 1.0,
            "top_k": -1 <= self.top_k <= INT64_MAX,
            "min_p": 0.0 <= self.min_p <= 1.0,
            "repetition_penalty": self.MIN_REPETITION_PENALTY <= self.repetition_penalty <= 10.0,
            "presence_penalty": -2.0 <= self.presence_penalty <= 2.0,
            "frequency_penalty": -2.0 <= self.frequency_penalty <= 2.0,
            "max_tokens": 1 <= self.max_tokens <= INT64_MAX,
            "min_tokens": 0 <= self.min_tokens <= self.max_tokens,
            "logprobs": self.logprobs is None or 0 <= self.logprobs <= self.MAX_LOGPROBS,
            "prompt_logprobs": self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= self.MAX_LOGPROBS,
            "seed": self.seed is None or seed_min <= self.seed <= seed_max,
            "stop_token_ids": all(0 <= t <= INT64_MAX for t in self.stop_token_ids),
            "logit_bias": not self.logit_bias or all(0 <= t <= INT64_MAX for t in self.logit_bias),
            "allowed_token_ids": self.allowed_token_ids is None or (
                bool(self.allowed_token_ids) and all(0 <= t <= INT64_MAX for t in self.allowed_token_ids)
            ),
        }
        for param, ok in in_range.items():
            if not ok:
                raise InvalidParameterError(param, self.range_message(param))

    @classmethod
    def clamped_bias(cls, bias: object) -> float:
        """A ``logit_bias`` value as a float within ±:attr:`MAX_LOGIT_BIAS` (OpenAI's range, into which vLLM's
        server clamps it: -1e9 bans a token as -100 does); :class:`InvalidParameterError` for no finite number."""
        limit = cls.MAX_LOGIT_BIAS
        return min(limit, max(-limit, as_number("logit_bias", bias, integer=False)))

    @classmethod
    def range_message(cls, param: str) -> str:
        """What :meth:`validate` says when ``param`` is out of its range."""
        seed_min, seed_max = cls.SEED_RANGE
        return {
            "n": f"n must be between 1 and {cls.MAX_N}",
            "temperature": "temperature must be between 0 and 100",
            "top_p": "top_p must be in (0, 1]",
            "top_k": f"top_k must be -1 or 0 (disabled) or a positive integer up to {INT64_MAX}",
            "min_p": "min_p must be in [0, 1]",
            "repetition_penalty": f"repetition_penalty must be in [{cls.MIN_REPETITION_PENALTY}, 10]",
            "presence_penalty": "presence_penalty must be in [-2, 2]",
            "frequency_penalty": "frequency_penalty must be in [-2, 2]",
            "max_tokens": f"max_tokens must be between 1 and {INT64_MAX}",
            "min_tokens": "min_tokens must be in [0, max_tokens]",
            "logprobs": f"logprobs must be between 0 and {cls.MAX_LOGPROBS}",
            "prompt_logprobs": f"prompt_logprobs must be between 0 and {cls.MAX_LOGPROBS}",
            "seed": f"seed must be between {seed_min} and {seed_max}",
            "stop_token_ids": f"stop_token_ids must be between 0 and {INT64_MAX}",
            "logit_bias": f"logit_bias maps token ids (0 to {INT64_MAX}) to numbers",
            "allowed_token_ids": f"allowed_token_ids must be a non-empty list of token ids between 0 and {INT64_MAX}",
        }[param]

    @property
    def greedy(self) -> bool:
        return self.temperature < self.GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def biases_logits(self) -> bool:
        """Whether ``logit_bias`` or ``allowed_token_ids`` change the logits."""
        return bool(self.logit_bias) or self.allowed_token_ids is not None

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
