"""PyTorch reference for LayerNorm / RMSNorm fused with the residual add of a pre-norm block."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def add_norm_ref(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    rms: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``r = residual + x`` (``x`` alone when ``residual`` is None); returns ``(norm(r) [..., N], r)``.

    LayerNorm (``rms=False``) or RMSNorm over the last dimension, in ``x``'s dtype.
    """
    summed = x if residual is None else residual + x
    if rms:
        r = summed.float()
        normed = r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
        if bias is not None:
            normed = normed + bias.float()
        return normed.to(x.dtype), summed
    return F.layer_norm(summed, (summed.shape[-1],), weight, bias, eps), summed
