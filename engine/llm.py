"""Offline batch generation: ``LLM(model, **engine_options).generate(prompts, SamplingParams(...))``, and
``.chat(messages, ...)`` for conversations rendered with the model's chat template."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from rnnserve.engine.chat_template import find_chat_template, model_directory, render_chat
from rnnserve.engine.config import EngineConfig
from rnnserve.engine.llm_engine import LLMEngine, freeze_startup_heap, retain_freed_memory
from rnnserve.engine.outputs import RequestOutput
from rnnserve.engine.sampling_params import OutputKind, SamplingParams
from rnnserve.engine.tokenizer import Tokenizer

Prompt = str | list[int]
Message = dict[str, Any]  # {"role": ..., "content": ...} and what a chat template reads (tool_calls, name, ...)


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(p, int) for p in prompts):
        return [prompts]  # type: ignore[list-item]
    return prompts  # type: ignore[return-value]


class LLM:
    """Load a model and generate for many prompts at once with continuous batching.

    ``model`` is a checkpoint directory, a Hugging Face repo id in the local cache, ``random:<preset>`` or a
    registered name (e.g. ``lsrl:majority``); ``None`` is the embedded default model. Every other
    :class:`~rnnserve.engine.config.EngineConfig` field is a keyword (``device``, ``dtype``, ``max_num_seqs``,
    ``state_memory``, ``max_model_len``, ...), the same options as ``rnnserve serve``'s flags.
    """

    def __init__(self, model: str | None = None, **engine_options: Any) -> None:
        self.engine = LLMEngine.from_config(EngineConfig(model=model, **engine_options))
        self._model_dir = model_directory(model) if model is not None else None
        freeze_startup_heap()
        retain_freed_memory()

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; results come back in prompt order (the engine builds only the final
        outputs, whatever the params' ``output_kind``)."""
        prompt_list = _as_prompt_list(prompts)
        if params is None or isinstance(params, SamplingParams):
            param_list = [params or SamplingParams()] * len(prompt_list)
        else:
            param_list = list(params)
            if len(param_list) != len(prompt_list):
                raise ValueError(f"{len(prompt_list)} prompts but {len(param_list)} sampling params")
        final_only = {id(sp): dataclasses.replace(sp, output_kind=OutputKind.FINAL_ONLY) for sp in param_list}
        ids = [self.engine.add_request(p, final_only[id(sp)]) for p, sp in zip(prompt_list, param_list, strict=True)]
        final: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[i] for i in ids]

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Reply to one conversation (a list of ``{"role", "content"}`` messages) or to each of a list of them,
        as vLLM's ``LLM.chat``: each is rendered with the chat template the server would use (``chat_template``,
        a template's source, overrides it: see :mod:`rnnserve.engine.chat_template`), then generated like
        :meth:`generate`'s prompts. ``tools`` (OpenAI's shape) and ``chat_template_kwargs`` become template
        variables."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        template = chat_template or find_chat_template(self.tokenizer, None, self._model_dir)
        variables = {**({"tools": tools} if tools else {}), **(chat_template_kwargs or {})}
        prompts = [
            render_chat(self.tokenizer, list(conversation), add_generation_prompt, continue_final_message, template,
                        variables)  # fmt: skip
            for conversation in conversations
        ]
        return self.generate(prompts, params)
