"""Gated MLPs: ``down(act(gate(x)) * up(x))``, e.g. Gemma's GeGLU (tanh GELU) and SwiGLU (SiLU)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from rnnserve.engine.models.layers.linear import linear


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU with the tanh approximation (Gemma's ``gelu_pytorch_tanh``)."""
    return F.gelu(x, approximate="tanh")


class GatedMLP(nn.Module):
    """``down_proj(activation(gate_proj(x)) * up_proj(x))``; SwiGLU with the default SiLU activation."""

    def __init__(
        self,
        dim: int,
        width: int,
        activation: Callable[[torch.Tensor], torch.Tensor] = F.silu,
        bias: bool = False,
    ) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, width, bias=bias)
        self.up_proj = nn.Linear(dim, width, bias=bias)
        self.down_proj = nn.Linear(width, dim, bias=bias)
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(self.down_proj, self.activation(linear(self.gate_proj, x)) * linear(self.up_proj, x))
