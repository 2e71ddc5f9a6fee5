"""Request bodies of the OpenAI-compatible API and their mapping onto :class:`SamplingParams`.

Field names follow OpenAI; vLLM's extras (``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``,
``ignore_eos``, ``stop_token_ids``, ``allowed_token_ids``, ``structured_outputs`` and its earlier ``guided_*``
spelling, ``prompt_logprobs``, ``chat_template_kwargs``) are accepted too. Fields
this server does not know are ignored and named in a warning in the log, as vLLM does
(:meth:`APIModel.unknown_fields`), so clients that send newer OpenAI fields keep working; known features it
cannot serve (``suffix``, tools, image parts, ...) are a 400. Parsing is strict (no bools or
floats where integers are expected, no NaN or infinities); the numeric ranges are :class:`SamplingParams`'
own, so the server and the offline API accept the same values.
"""

from __future__ import annotations

import json
import re
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, model_validator

from rnnserve.engine.chat_template import check_generation_prompt, content_text
from rnnserve.engine.sampling_params import (
    InvalidParameterError,
    OutputKind,
    SamplingParams,
    StructuredOutputParams,
)

MAX_TOKEN_ID_DIGITS = 18  # a logit_bias key longer than this is no token id (and int() refuses 4300 digits)


class APIModel(BaseModel):
    """A request body: known fields strictly typed, unknown fields kept aside (ignored, then logged)."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False, strict=True)
    # Fields OpenAI declares nullable whose value here is never null: ``null`` reads as the field left out.
    NULL_MEANS_DEFAULT: ClassVar[frozenset[str]] = frozenset()
    # vLLM fields this server does not serve, each with the values that ask for nothing (vLLM's default, null):
    # ignored like unknown fields, any other value would change the answer without a word, so it is a 400.
    UNSERVED_VLLM_FIELDS: ClassVar[dict[str, tuple[Any, ...]]] = {}

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        if isinstance(data, dict) and cls.NULL_MEANS_DEFAULT:
            return {k: v for k, v in data.items() if v is not None or k not in cls.NULL_MEANS_DEFAULT}
        return data

    def check_unserved_fields(self) -> None:
        """An InvalidParameterError for the first of :attr:`UNSERVED_VLLM_FIELDS` sent with a value that asks for
        something."""
        extra = self.model_extra or {}
        for name, inert in self.UNSERVED_VLLM_FIELDS.items():
            if name in extra and not any(extra[name] == value and type(extra[name]) is type(value) for value in inert):
                raise InvalidParameterError(
                    name, f"{name} (vLLM) is not supported by this server: leave it out (or send its default)"
                )

    def unknown_fields(self, prefix: str = "") -> list[str]:
        """Dotted names of the fields this server ignored, nested request objects included."""
        names = [prefix + name for name in self.model_extra or {}]
        for name in sorted(self.model_fields_set):  # a nested object has unknown fields only if it was sent
            value = getattr(self, name)
            if isinstance(value, APIModel):
                names += value.unknown_fields(f"{prefix}{name}.")
        return names


class StreamOptions(APIModel):
    NULL_MEANS_DEFAULT = frozenset({"include_usage"})

    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(APIModel):
    """Fields shared by both endpoints."""

    NULL_MEANS_DEFAULT = frozenset({"n", "stream"})
    UNSERVED_VLLM_FIELDS = {
        "use_beam_search": (None, False),
        "length_penalty": (None, 1, 1.0),
        "truncate_prompt_tokens": (None,),
        "bad_words": (None, []),
        "return_tokens_as_token_ids": (None, False),
    }

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
    response_format: dict[str, Any] | None = None
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
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stop_token_ids: list[int] | None = None
    allowed_token_ids: list[int] | None = None
    structured_outputs: dict[str, Any] | None = None
    # vLLM's earlier spelling of structured_outputs, still sent by many clients: read as structured_outputs
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    prompt_logprobs: int | None = None
    # rnnserve: continue a persistent session (POST /v1/sessions)
    session_id: str | None = None

    def check_supported(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise InvalidParameterError(
                "stream_options", "stream_options is only allowed when stream is true"
            )
        self.check_unserved_fields()

    def in_request_terms(self, err: InvalidParameterError) -> InvalidParameterError:
        """A parameter error, raised building the engine's parameters or by the engine at submission, in this
        request's terms (the field the client sent)."""
        return err

    def sampling_params(
        self,
        max_tokens: int,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
        fit_max_tokens: bool = False,
    ) -> SamplingParams:
        """Build and validate the engine's parameters (raises InvalidParameterError naming the field). A stream
        reads each step's delta, a plain response only the final output. ``fit_max_tokens`` for a default
        ``max_tokens`` (the client gave none): the engine shortens it to the room the prompt leaves."""
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
                include_stop_str_in_output=self.include_stop_str_in_output,
                skip_special_tokens=self.skip_special_tokens,
                logprobs=logprobs,
                prompt_logprobs=self.prompt_logprobs if prompt_logprobs is None else prompt_logprobs,
                logit_bias=self.token_biases(),
                allowed_token_ids=self.allowed_token_ids,
                structured_outputs=self.structured_output_params(),
                output_kind=OutputKind.DELTA if self.stream else OutputKind.FINAL_ONLY,
                fit_max_tokens=fit_max_tokens,
            )
        except InvalidParameterError as err:
            explained = self.in_request_terms(err)
            if explained is err:
                raise
            raise explained from err

    def structured_output_params(self) -> StructuredOutputParams | None:
        """OpenAI's ``response_format`` (``json_object``, ``json_schema``) or vLLM's ``structured_outputs``
        (``json``, ``json_object``, ``regex``, ``choice``, ``grammar``, ``disable_any_whitespace``) as the engine's
        constraint; ``None`` for plain text."""
        from_format = self._response_format()
        options = self.structured_outputs
        guided = self._guided()
        if guided is not None:
            if options is not None or from_format is not None:
                raise InvalidParameterError(guided.param, f"give {guided.param} or response_format / "
                                            "structured_outputs, not both")  # fmt: skip
            return guided
        if options is None:
            return from_format
        if from_format is not None:
            raise InvalidParameterError("structured_outputs", "give response_format or structured_outputs, not both")
        return StructuredOutputParams.from_options(options)

    def _guided(self) -> StructuredOutputParams | None:
        """vLLM's ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` as the constraint."""
        if self.guided_whitespace_pattern is not None:
            raise InvalidParameterError(
                "guided_whitespace_pattern",
                "guided_whitespace_pattern is not supported: structured_outputs.disable_any_whitespace (default "
                "true) chooses between compact JSON and any whitespace",
            )
        given = {kind: value for kind in ("json", "regex", "choice", "grammar")
                 if (value := getattr(self, f"guided_{kind}")) is not None}  # fmt: skip
        if not given:
            return None
        names = [f"guided_{kind}" for kind in given]
        if len(given) > 1:
            raise InvalidParameterError(names[1], f"give one of {', '.join(names)}")
        return StructuredOutputParams(**given, param=names[0])

    def _response_format(self) -> StructuredOutputParams | None:
        param = "response_format"
        response_format = self.response_format
        if response_format is None or response_format.get("type") == "text":
            return None
        kind = response_format.get("type")
        if kind == "json_object":
            return StructuredOutputParams(json_object=True, param=param)
        if kind == "json_schema":
            spec = response_format.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise InvalidParameterError(param, "response_format.json_schema.schema must be a JSON schema object")
            return StructuredOutputParams(json=schema, param=param)
        raise InvalidParameterError(param, "response_format type must be 'text', 'json_object' or 'json_schema'")

    def token_biases(self) -> dict[int, float] | None:
        """``logit_bias`` with its keys (token ids written as JSON strings) as integers."""
        if self.logit_bias is None:
            return None
        biases: dict[int, float] = {}
        for key, bias in self.logit_bias.items():
            token = key.strip()
            if not token.isdigit() or not token.isascii():
                raise InvalidParameterError("logit_bias", f"logit_bias keys must be token ids, got {key[:40]!r}")
            digits = token.lstrip("0") or "0"
            if len(digits) > MAX_TOKEN_ID_DIGITS:
                raise InvalidParameterError("logit_bias", f"logit_bias key {digits[:40]}... is not a token id")
            biases[int(digits)] = bias
        return biases

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage on every streamed chunk, not only in the last one."""
        return bool(self.include_usage and self.stream_options and self.stream_options.continuous_usage_stats)


COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class CompletionRequest(SamplingFields):
    NULL_MEANS_DEFAULT = SamplingFields.NULL_MEANS_DEFAULT | {"echo"}

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = None  # COMPLETIONS_DEFAULT_MAX_TOKENS, cut to the room the prompt leaves
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
            if self.session_id is not None:  # no new token ids, as "" has no new text: the session continues
                return [[]]
            raise InvalidParameterError("prompt", "prompt is empty")
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)]  # type: ignore[arg-type]
        return list(prompt)  # type: ignore[arg-type]

    @property
    def echo_only(self) -> bool:
        """``echo`` with ``max_tokens: 0``: the answer is the prompt alone (with its logprobs, if asked)."""
        return self.echo and self.max_tokens == 0

    def in_request_terms(self, err: InvalidParameterError) -> InvalidParameterError:
        if self.echo_only and err.param == "max_tokens":  # the one token sampled and left out is the engine's
            return InvalidParameterError(
                "prompt", "the prompt is too long for echo with max_tokens 0, which needs it at least one token "
                "shorter than max_model_len"
            )
        return err

    def to_sampling_params(self, default_max_tokens: int = COMPLETIONS_DEFAULT_MAX_TOKENS) -> SamplingParams:
        """``echo`` with ``logprobs = N`` asks the engine for the prompt's logprobs with top ``N`` too. With
        ``echo_only`` the engine still samples one token (the prompt's logits are computed anyway), which the
        response leaves out, as vLLM does."""
        if self.suffix:
            raise InvalidParameterError("suffix", "suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidParameterError("best_of", "best_of other than n is not supported")
        if self.max_tokens == 0 and not self.echo:
            raise InvalidParameterError("max_tokens", "max_tokens must be at least 1 (0 only with echo)")
        max_tokens = default_max_tokens if self.max_tokens is None else self.max_tokens
        prompt_logprobs = self.prompt_logprobs
        if self.echo and self.logprobs is not None:
            prompt_logprobs = max(self.logprobs, prompt_logprobs or 0)
        return self.sampling_params(
            1 if self.echo_only else max_tokens, self.logprobs, prompt_logprobs, fit_max_tokens=self.max_tokens is None
        )


class ContentPart(BaseModel):
    """One part of a message's content; only ``text`` parts (and an assistant's ``refusal`` parts, text too) can be
    served (the models read text only)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    type: str
    text: str | None = None
    refusal: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # the call a tool message answers

    def template_fields(self) -> dict[str, Any]:
        """The message as a chat template reads it: role, text, and the tool-call fields that were sent (each
        call's ``arguments`` as an object where they are JSON text, as Hugging Face templates expect)."""
        fields: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            fields["name"] = self.name
        if self.tool_call_id is not None:
            fields["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            fields["tool_calls"] = [_call_for_template(call) for call in self.tool_calls]
        return fields

    def text(self) -> str:
        """The message's text; :class:`InvalidParameterError` for a part that is not text (an image, ...)."""
        content = self.content
        if not isinstance(content, list):
            return content_text(content)
        return content_text([part.model_dump(exclude_none=True) for part in content])


def _call_for_template(call: dict[str, Any]) -> dict[str, Any]:
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except ValueError:
        return call
    return {**call, "function": {**function, "arguments": arguments}}


TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    """One entry of ``tools``: a function the model may be made to call."""

    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["function"]
    function: FunctionDefinition

    @property
    def parameters(self) -> dict[str, Any]:
        """The arguments' JSON schema (a function without one takes an empty object, ``{}``: OpenAI's "empty
        parameter list")."""
        if not self.function.parameters:
            return {"type": "object", "properties": {}, "additionalProperties": False}
        return self.function.parameters


def with_tools(template_kwargs: dict[str, Any] | None, tools: list[Tool] | None) -> dict[str, Any] | None:
    """A chat template's extra variables with ``tools`` (OpenAI's shape, as Hugging Face templates read it)."""
    if not tools:
        return template_kwargs
    return {"tools": [tool.model_dump(exclude_none=True) for tool in tools], **(template_kwargs or {})}


class ChatCompletionRequest(SamplingFields):
    NULL_MEANS_DEFAULT = SamplingFields.NULL_MEANS_DEFAULT | {"logprobs"}
    # chat's echo: the last message again; chat_template: a template of the request's own (vLLM refuses it too,
    # unless started with --trust-request-chat-template)
    UNSERVED_VLLM_FIELDS = {**SamplingFields.UNSERVED_VLLM_FIELDS, "echo": (None, False), "chat_template": (None,)}

    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # OpenAI's deprecated spelling of tools: refused with a 400 (its answers have a shape this server does not write)
    functions: list[Any] | None = None
    function_call: str | dict[str, Any] | None = None
    # vLLM extras
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    def in_request_terms(self, err: InvalidParameterError) -> InvalidParameterError:
        sent = {"logprobs": "top_logprobs"}  # the engine's number of alternatives is chat's top_logprobs
        if self.max_completion_tokens is not None:
            sent["max_tokens"] = "max_completion_tokens"
        name = sent.get(err.param)
        return err if name is None else InvalidParameterError(name, str(err).replace(err.param, name))

    def to_sampling_params(self, default_max_tokens: int) -> SamplingParams:
        if not self.messages:
            raise InvalidParameterError("messages", "messages must not be empty")
        check_generation_prompt(self.add_generation_prompt, self.continue_final_message)
        for deprecated, current in (("functions", "tools"), ("function_call", "tool_choice")):
            if getattr(self, deprecated) is not None:
                raise InvalidParameterError(
                    deprecated, f"{deprecated} (deprecated by OpenAI) is not supported: send {current}"
                )
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidParameterError("top_logprobs", "top_logprobs requires logprobs to be true")
        if self.prompt_logprobs is not None and self.stream:  # a chat chunk has no place for them (vLLM: 400 too)
            raise InvalidParameterError("prompt_logprobs", "prompt_logprobs is not available with stream")
        if self.max_completion_tokens is not None:
            max_tokens = self.max_completion_tokens
        else:
            max_tokens = default_max_tokens if self.max_tokens is None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        defaulted = self.max_tokens is None and self.max_completion_tokens is None
        params = self.sampling_params(max_tokens, logprobs, fit_max_tokens=defaulted)
        calls = self.forced_tool_calls()
        if calls is None:
            return params
        if params.structured_outputs is not None:
            param = "response_format" if self.response_format is not None else "structured_outputs"
            raise InvalidParameterError(param, f"{param} cannot be combined with tool_choice {self.tool_choice!r}")
        params.structured_outputs = calls
        return params

    @property
    def tool_mode(self) -> Literal["named", "required"] | None:
        """How the answer calls tools: ``named`` (the one function ``tool_choice`` names: the output is its
        arguments), ``required`` (one or more calls of any of ``tools``: the output is a JSON list of
        ``{"name", "parameters"}``), or ``None`` (text). ``auto`` with tools (also implied: tools without a
        ``tool_choice``) needs a parser of the model's own tool-call format, which this server does not have (as
        vLLM without ``--tool-call-parser``): a 400."""
        choice = self.tool_choice if self.tool_choice is not None else ("auto" if self.tools else "none")
        if choice == "none" or (choice == "auto" and not self.tools):
            return None
        if choice == "auto":
            raise InvalidParameterError(
                "tool_choice", "tool_choice 'auto' needs a parser of the model's tool-call format, which this server "
                "does not have: ask for 'required' or name a function ({'type': 'function', 'function': {'name': ...}})"
            )
        if not self.tools:
            raise InvalidParameterError("tools", f"tool_choice {choice!r} needs tools")
        if choice == "required":
            return "required"
        if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
            return "named"
        raise InvalidParameterError(
            "tool_choice",
            "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}",
        )

    def named_tool(self) -> Tool:
        """The tool ``tool_choice`` names."""
        name = self.tool_choice["function"].get("name")  # type: ignore[index]
        tool = next((t for t in self.tools or () if t.function.name == name), None)
        if tool is None:
            raise InvalidParameterError("tool_choice", f"tool_choice names {name!r}, which is not in tools")
        return tool

    def forced_tool_calls(self) -> StructuredOutputParams | None:
        """The constraint that makes the answer a call of the named tool or a list of calls (``required``), or
        ``None`` when the answer is text."""
        mode = self.tool_mode
        if mode is None:
            return None
        tools = self.tools or []
        names = [t.function.name for t in tools]
        bad = next((n for n in names if not TOOL_NAME.fullmatch(n)), None)
        if bad is not None:
            raise InvalidParameterError("tools", f"tool name {bad!r} must be 1 to 64 letters, digits, '_' or '-'")
        if len(set(names)) != len(names):
            raise InvalidParameterError("tools", "tool names must be unique")
        if mode == "named":
            return StructuredOutputParams(json=self.named_tool().parameters, param="tools")
        calls = [
            {
                "type": "object",
                # each tool's schema a resource of its own: its "#/$defs/..." refs resolve in it, not in this root
                "properties": {"name": {"const": t.function.name},
                               "parameters": {"$id": f"urn:rnnserve:tool:{t.function.name}", **t.parameters}},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }  # fmt: skip
            for t in tools
        ]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if self.parallel_tool_calls is False:
            schema["maxItems"] = 1
        return StructuredOutputParams(json=schema, param="tools")

    def template_kwargs(self) -> dict[str, Any] | None:
        """``chat_template_kwargs`` with ``tools`` added as the template reads them (left out with
        ``tool_choice: "none"``; ``chat_template_kwargs`` may set its own)."""
        return with_tools(self.chat_template_kwargs, None if self.tool_choice == "none" else self.tools)


class TokenizeRequest(APIModel):
    UNSERVED_VLLM_FIELDS = {"chat_template": (None,)}

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    def template_kwargs(self) -> dict[str, Any] | None:
        return with_tools(self.chat_template_kwargs, self.tools)


class DetokenizeRequest(APIModel):
    model: str | None = None
    tokens: list[int]


class SessionRequest(APIModel):
    """``POST /v1/sessions``: an empty session (its first request's prompt starts it)."""

    model: str | None = None
