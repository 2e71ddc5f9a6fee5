"""Offline batch generation: ``LLM(model).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rnnserve.engine.llm_engine import EngineConfig, LLMEngine
from rnnserve.engine.loader import load_model
from rnnserve.engine.outputs import RequestOutput
from rnnserve.engine.sampling_params import SamplingParams
from rnnserve.engine.tokenizer import Tokenizer

Prompt = str | list[int]


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(p, int) for p in prompts):
        return [prompts]  # type: ignore[list-item]
    return prompts  # type: ignore[return-value]


class LLM:
    """Load a model and generate for many prompts at once with continuous batching.

    ``model`` is a checkpoint directory, ``random:<preset>`` or a registered name (e.g. ``lsrl:majority``).
    ``device="auto"`` uses CUDA when present. The state pool holds ``max_num_seqs`` slots, or as many as
    fit in ``state_memory`` bytes (the smaller of both when both are given). On CUDA, decode replays CUDA
    graphs unless ``enforce_eager``.
    """

    def __init__(
        self,
        model: str,
        device: str = "auto",
        dtype: str | torch.dtype | None = None,
        max_num_seqs: int | None = 64,
        state_memory: int | None = None,
        max_num_batched_tokens: int = 2048,
        enforce_eager: bool = False,
    ) -> None:
        loaded, tokenizer = load_model(model, device=device, dtype=dtype)
        config = EngineConfig(
            max_num_seqs=max_num_seqs,
            state_memory=state_memory,
            max_num_batched_tokens=max_num_batched_tokens,
            enforce_eager=enforce_eager,
        )
        self.engine = LLMEngine(loaded, tokenizer, config)

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; results come back in prompt order."""
        prompt_list = _as_prompt_list(prompts)
        if params is None or isinstance(params, SamplingParams):
            param_list = [params or SamplingParams()] * len(prompt_list)
        else:
            param_list = list(params)
            if len(param_list) != len(prompt_list):
                raise ValueError(f"{len(prompt_list)} prompts but {len(param_list)} sampling params")
        ids = [self.engine.add_request(p, sp) for p, sp in zip(prompt_list, param_list, strict=True)]
        final: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[i] for i in ids]
