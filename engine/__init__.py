"""rnnserve engine: state pool, scheduler, models, sampling, tokenizers and loaders."""

from rnnserve.engine.llm import LLM
from rnnserve.engine.outputs import CompletionOutput, RequestOutput
from rnnserve.engine.sampling_params import SamplingParams, StructuredOutputParams

__all__ = ["LLM", "SamplingParams", "StructuredOutputParams", "RequestOutput", "CompletionOutput"]
