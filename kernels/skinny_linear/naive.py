"""PyTorch reference for the skinny linear: ``torch.nn.functional.linear``."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def skinny_linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias``."""
    return F.linear(x, weight, bias)
