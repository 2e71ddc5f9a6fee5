"""Model registry: importing this package registers every architecture and its ``random:`` presets."""

from engine.models import minrnn  # noqa: F401  (registers mingru, minlstm)
from engine.models.base import MODEL_REGISTRY, PRESETS, ModelConfig, RecurrentLM, StateSpec

__all__ = ["MODEL_REGISTRY", "PRESETS", "ModelConfig", "RecurrentLM", "StateSpec"]
