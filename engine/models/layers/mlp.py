"""Gated MLPs: ``down(act(gate(x)) * up(x))``, e.g. Gemma's GeGLU (tanh GELU) and SwiGLU (SiLU)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rnnserve.engine.models.layers.linear import linear
from rnnserve.kernels.gated_act import gated_act


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU with the tanh approximation (Gemma's ``gelu_pytorch_tanh``)."""
    return F.gelu(x, approximate="tanh")


class GatedMLP(nn.Module):
    """``down_proj(activation(gate_proj(x)) * up_proj(x))``; ``activation`` ``"silu"`` (SwiGLU, the default) or
    ``"gelu_tanh"`` (GeGLU), applied with the product in one op (:func:`rnnserve.kernels.gated_act.gated_act`)."""

    def __init__(self, dim: int, width: int, activation: str = "silu", bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, width, bias=bias)
        self.up_proj = nn.Linear(dim, width, bias=bias)
        self.down_proj = nn.Linear(width, dim, bias=bias)
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(self.down_proj, gated_act(linear(self.gate_proj, x), linear(self.up_proj, x), self.activation))
