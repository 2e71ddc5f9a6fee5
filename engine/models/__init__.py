"""Model registry: importing this package registers every architecture and its ``random:`` presets."""

from engine.models import classic_rnn, lsrl, mamba, minrnn  # noqa: F401  (each module registers its models)
from engine.models.base import MODEL_REGISTRY, PRESETS, ModelConfig, RecurrentLM, StateSpec

__all__ = ["MODEL_REGISTRY", "PRESETS", "ModelConfig", "RecurrentLM", "StateSpec"]
