"""PyTorch reference for the weight-only int8 linear layer: dequantize, then an fp32 matmul."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def dequantize(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """int8 ``weight [N, K]`` with per-row ``scale [N]`` -> the fp32 weight ``weight * scale[:, None]``."""
    return weight.float() * scale.float()[:, None]


def int8_linear_ref(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ dequantize(weight, scale).T + bias`` computed in fp32 and rounded once to ``x``'s dtype."""
    out = F.linear(x.float(), dequantize(weight, scale), None if bias is None else bias.float())
    return out.to(x.dtype)
