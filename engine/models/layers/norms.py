"""RMSNorm variants: Mamba's (``weight``), Gemma's (``1 + weight``) and weightless; statistics in fp32."""

from __future__ import annotations

import torch
from torch import nn

from rnnserve.kernels.residual_rms_norm import residual_rms_norm
from rnnserve.kernels.residual_rms_norm.naive import rms_normalize


def weightless_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without a weight, in ``x``'s dtype (FalconMamba's norm on dt, B and C)."""
    return rms_normalize(x, eps).to(x.dtype)


class RMSNorm(nn.Module):
    """Mamba's RMSNorm (scale ``weight``, initialised to 1), rounding as the Hugging Face reference.

    Mixer stacks apply it fused with the residual add (:func:`rnnserve.kernels.residual_rms_norm.residual_rms_norm`,
    reading ``weight`` and ``eps``); ``forward`` is the same norm without the add.
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return residual_rms_norm(x, None, self.weight, self.eps)[0]


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: fp32 throughout, scale ``1 + weight`` (``weight`` initialised to 0)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (rms_normalize(x, self.eps) * (1.0 + self.weight.float())).to(x.dtype)
