"""PyTorch reference for the GEMV / skinny GEMM: ``x @ weight.T + bias`` computed in fp32, rounded once."""

from __future__ import annotations

import torch


def gemv_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K] @ weight[N, K].T + bias`` in fp32 on the operands' values, rounded once to ``x``'s dtype."""
    out = x.float() @ weight.float().t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)
