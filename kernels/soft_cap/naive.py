"""Reference logit soft-capping: ``cap * tanh(logits / cap)`` (Gemma, RecurrentGemma)."""

from __future__ import annotations

import torch


def soft_cap_ref(logits: torch.Tensor, cap: float) -> torch.Tensor:
    """``cap * tanh(logits / cap)`` as the Hugging Face models compute it."""
    return torch.tanh(logits / cap) * cap
