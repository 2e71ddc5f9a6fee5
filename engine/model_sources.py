"""Model sources: what a ``<prefix>:<name>`` model name loads from.

``random:<preset>`` builds a randomly initialised registered preset and ``lsrl:<program>`` compiles a built-in
LSRL program; anything else is a checkpoint directory or a Hugging Face repo id in the local cache (see
:func:`rnnserve.engine.loader.load_model`). A source is registered as a callable, or as a lazy
``"module:function"`` reference that is imported on first use, so this registry imports no model code.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from rnnserve.engine.models.base import RecurrentLM
    from rnnserve.engine.tokenizer import Tokenizer

Loaded = tuple["RecurrentLM", "Tokenizer"]
ModelSource = Callable[[str, torch.device, "torch.dtype | None"], Loaded]


class ModelLoadError(ValueError):
    """A model could not be loaded; the message names the problem in one line."""


MODEL_SOURCES: dict[str, ModelSource | str] = {
    "random": "rnnserve.engine.loader:build_random",
    "lsrl": "rnnserve.engine.lsrl.builtins:load_builtin",
}


def model_source(prefix: str) -> ModelSource | None:
    """The source registered for ``prefix``, imported on first use; ``None`` when there is none."""
    source = MODEL_SOURCES.get(prefix)
    if isinstance(source, str):
        module, _, function = source.partition(":")
        source = MODEL_SOURCES[prefix] = getattr(importlib.import_module(module), function)
    return source
