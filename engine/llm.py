"""Offline batch generation: ``LLM(model, **engine_options).generate(prompts, SamplingParams(...))``, and
``.chat(messages, ...)`` for conversations rendered with the model's chat template."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from rnnserve.engine.chat_template import find_chat_template, model_directory, render_chat, template_messages
from rnnserve.engine.config import EngineConfig
from rnnserve.engine.llm_engine import LLMEngine, freeze_startup_heap, retain_freed_memory
from rnnserve.engine.outputs import RequestOutput
from rnnserve.engine.sampling_params import OutputKind, SamplingParams
from rnnserve.engine.tokenizer import Tokenizer

Prompt = str | list[int]
Message = dict[str, Any]  # {"role": ..., "content": ...} and what a chat template reads (tool_calls, name, ...)


class GenerationError(RuntimeError):
    """The engine failed some of a call's requests; ``outputs`` holds every request's final output, in prompt
    order (the failed ones with ``error`` set and ``finish_reason`` ``"error"``)."""

    def __init__(self, outputs: list[RequestOutput]) -> None:
        failed = [out for out in outputs if out.error is not None]
        super().__init__(f"{len(failed)} of {len(outputs)} requests failed; the first: {failed[0].error}")
        self.outputs = outputs


def _one_prompt(prompt: Any) -> Prompt:
    """A text, a list of token ids, or vLLM's ``{"prompt": text}`` / ``{"prompt_token_ids": ids}``."""
    if isinstance(prompt, Mapping):
        if set(prompt) == {"prompt"} and isinstance(prompt["prompt"], str):
            return prompt["prompt"]
        if set(prompt) == {"prompt_token_ids"}:
            return list(prompt["prompt_token_ids"])
        raise TypeError(f"a prompt dict holds 'prompt' (text) or 'prompt_token_ids' alone, got keys {sorted(prompt)}")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list | tuple):
        return list(prompt)  # token ids, checked by the engine
    raise TypeError(f"a prompt is a text, a list of token ids or a prompt dict, got {type(prompt).__name__}")


def _as_prompt_list(prompts: Any) -> list[Prompt]:
    if isinstance(prompts, str | Mapping):
        return [_one_prompt(prompts)]
    if not isinstance(prompts, list | tuple):
        raise TypeError(f"prompts: a prompt or a list of prompts, got {type(prompts).__name__}")
    if prompts and not isinstance(prompts[0], str | list | tuple | Mapping):  # one prompt of token ids
        return [_one_prompt(prompts)]
    return [_one_prompt(p) for p in prompts]


class LLM:
    """Load a model and generate for many prompts at once with continuous batching.

    ``model`` is a checkpoint directory, a Hugging Face repo id in the local cache, ``random:<preset>`` or a
    registered name (e.g. ``lsrl:majority``); ``None`` is the embedded default model. Every other
    :class:`~rnnserve.engine.config.EngineConfig` field is a keyword (``device``, ``dtype``, ``max_num_seqs``,
    ``state_memory``, ``max_model_len``, ...), the same options as ``rnnserve serve``'s flags.

    Building one freezes the process's heap for the garbage collector (see ``freeze_startup_heap``): objects
    alive then are not collected as cycles later; ``gc.unfreeze()`` undoes it. Calls from several threads run
    one after the other.
    """

    def __init__(self, model: str | None = None, **engine_options: Any) -> None:
        self.engine = LLMEngine.from_config(EngineConfig(model=model, **engine_options))
        self._model_dir = model_directory(model) if model is not None else None
        self._lock = threading.Lock()
        freeze_startup_heap()
        retain_freed_memory()

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Any,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (a text, token ids, vLLM's ``{"prompt": ...}`` / ``{"prompt_token_ids":
        ...}``, or a list of those); results come back in prompt order (the engine builds only the final outputs,
        whatever the params' ``output_kind``). A prompt or parameter the engine refuses raises
        :class:`~rnnserve.engine.sampling_params.InvalidParameterError`, a request it fails
        :class:`GenerationError`; either way, and on Ctrl-C, none of the call's requests is left running."""
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            param_list = [sampling_params or SamplingParams()] * len(prompt_list)
        else:
            param_list = list(sampling_params)
            if len(param_list) != len(prompt_list):
                raise ValueError(f"{len(prompt_list)} prompts but {len(param_list)} sampling params")
        final_only = {id(sp): dataclasses.replace(sp, output_kind=OutputKind.FINAL_ONLY) for sp in param_list}
        with self._lock:
            ids: list[str] = []
            try:
                for prompt, sp in zip(prompt_list, param_list, strict=True):
                    ids.append(self.engine.add_request(prompt, final_only[id(sp)]))
                final: dict[str, RequestOutput] = {}
                while self.engine.has_unfinished_requests():
                    for out in self.engine.step():
                        if out.finished:
                            final[out.request_id] = out
            except BaseException:
                for request_id in ids:
                    self.engine.abort_request(request_id)
                raise
        outputs = [final[i] for i in ids]
        if any(out.error is not None for out in outputs):
            raise GenerationError(outputs)
        return outputs

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Reply to one conversation (a list of ``{"role", "content"}`` messages, content as text or OpenAI's
        text parts) or to each of a list of them, as vLLM's ``LLM.chat``: each is rendered with the chat template
        the server would use (``chat_template``, a template's source, overrides it: see
        :mod:`rnnserve.engine.chat_template`), then generated like :meth:`generate`'s prompts. ``tools``
        (OpenAI's shape) and ``chat_template_kwargs`` become template variables. ``continue_final_message``
        continues the last message's text (a reply begun by the caller) and needs ``add_generation_prompt=False``:
        both true raises :class:`~rnnserve.engine.sampling_params.InvalidParameterError` (a ``ValueError``), as
        the server answers a 400 and vLLM raises."""
        if not messages or isinstance(messages, str | Mapping):
            raise TypeError("messages: a list of message dicts, or a list of such lists")
        conversations = [messages] if isinstance(messages[0], Mapping) else messages
        template = chat_template or find_chat_template(self.tokenizer, None, self._model_dir)
        variables = {**({"tools": tools} if tools else {}), **(chat_template_kwargs or {})}
        prompts = [
            render_chat(self.tokenizer, template_messages(list(conversation)), add_generation_prompt,
                        continue_final_message, template, variables)  # fmt: skip
            for conversation in conversations
        ]
        return self.generate(prompts, sampling_params)
