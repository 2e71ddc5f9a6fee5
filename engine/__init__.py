"""rnnserve engine: state pool, scheduler, models, sampling, tokenizers and loaders."""

from rnnserve.engine.llm import LLM
from rnnserve.engine.outputs import CompletionOutput, RequestOutput
from rnnserve.engine.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
