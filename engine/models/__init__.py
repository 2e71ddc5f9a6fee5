"""Model registry: importing this package registers every architecture and its ``random:`` presets."""

# Importing each architecture module registers its models and presets.
from rnnserve.engine.models import (  # noqa: F401
    based,
    classic_rnn,
    lattice,
    looped,
    lsrl,
    mamba,
    mamba2,
    minrnn,
    recurrent_gemma,
)
from rnnserve.engine.models.base import MODEL_REGISTRY, PRESETS, ModelConfig, RecurrentLM, StateSpec

__all__ = ["MODEL_REGISTRY", "PRESETS", "ModelConfig", "RecurrentLM", "StateSpec"]
