"""Request bodies of the OpenAI-compatible API and their mapping onto :class:`SamplingParams`.

Field names follow OpenAI; vLLM's extras (``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``,
``ignore_eos``, ``stop_token_ids``) are accepted too. Unknown fields are rejected (as OpenAI does), except
for a few OpenAI fields that do not change generation here (``user``, ``metadata``, ...). Parsing is strict
(no bools or floats where integers are expected, no NaN or infinities); the numeric ranges are
:class:`SamplingParams`' own, so the server and the offline API accept the same values.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from rnnserve.engine.sampling_params import InvalidParameterError, SamplingParams


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)


class StreamOptions(StrictModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(StrictModel):
    """Fields shared by both endpoints."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None

    def check_supported(self) -> None:
        if self.logit_bias:
            raise InvalidParameterError("logit_bias", "logit_bias is not supported")
        if self.stream_options is not None and not self.stream:
            raise InvalidParameterError(
                "stream_options", "stream_options is only allowed when stream is true"
            )

    def sampling_params(self, max_tokens: int, logprobs: int | None, max_tokens_param: str) -> SamplingParams:
        """Build and validate the engine's parameters (raises InvalidParameterError naming the field)."""
        self.check_supported()
        try:
            return SamplingParams(
                n=self.n,
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=0 if self.top_k is None else self.top_k,
                min_p=0.0 if self.min_p is None else self.min_p,
                repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
                presence_penalty=self.presence_penalty or 0.0,
                frequency_penalty=self.frequency_penalty or 0.0,
                seed=self.seed,
                stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
                stop_token_ids=list(self.stop_token_ids or []),
                max_tokens=max_tokens,
                min_tokens=self.min_tokens,
                ignore_eos=self.ignore_eos,
                logprobs=logprobs,
            )
        except InvalidParameterError as err:
            if err.param == "max_tokens":
                raise InvalidParameterError(
                    max_tokens_param, str(err).replace("max_tokens", max_tokens_param)
                ) from err
            raise

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a list of single prompts (text or token ids)."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise InvalidParameterError("prompt", "prompt is empty")
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)]  # type: ignore[arg-type]
        return list(prompt)  # type: ignore[arg-type]

    def to_sampling_params(self, default_max_tokens: int) -> SamplingParams:
        if self.suffix:
            raise InvalidParameterError("suffix", "suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidParameterError("best_of", "best_of other than n is not supported")
        if self.echo and self.logprobs is not None:
            raise InvalidParameterError("echo", "echo together with logprobs is not supported")
        max_tokens = default_max_tokens if self.max_tokens is None else self.max_tokens
        return self.sampling_params(max_tokens, self.logprobs, "max_tokens")


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    # vLLM extras
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    def to_sampling_params(self, default_max_tokens: int) -> SamplingParams:
        if not self.messages:
            raise InvalidParameterError("messages", "messages must not be empty")
        if self.tools:
            raise InvalidParameterError("tools", "tool calling is not supported")
        if self.tool_choice not in (None, "none", "auto"):
            raise InvalidParameterError("tool_choice", "tool calling is not supported")
        if self.response_format is not None and self.response_format.get("type") != "text":
            raise InvalidParameterError("response_format", "only response_format type 'text' is supported")
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidParameterError("top_logprobs", "top_logprobs requires logprobs to be true")
        if self.max_completion_tokens is not None:
            max_tokens, param = self.max_completion_tokens, "max_completion_tokens"
        else:
            max_tokens = default_max_tokens if self.max_tokens is None else self.max_tokens
            param = "max_tokens"
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        try:
            return self.sampling_params(max_tokens, logprobs, param)
        except InvalidParameterError as err:
            if err.param == "logprobs":
                raise InvalidParameterError(
                    "top_logprobs", str(err).replace("logprobs", "top_logprobs")
                ) from err
            raise


class TokenizeRequest(StrictModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = True


class DetokenizeRequest(StrictModel):
    model: str | None = None
    tokens: list[int]
