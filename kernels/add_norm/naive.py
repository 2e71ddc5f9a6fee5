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

    ``r`` takes PyTorch's promoted dtype of the two (an fp32 residual stream stays fp32 with bf16 activations,
    as in the unfused ``stream + delta``). LayerNorm (``rms=False``) or RMSNorm over the last dimension of
    ``r`` as stored, statistics in fp32, the result rounded once to ``x``'s dtype.
    """
    summed = x if residual is None else residual + x
    if rms:
        r = summed.float()
        normed = r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
        if bias is not None:
            normed = normed + bias.float()
        return normed.to(x.dtype), summed
    shape = (summed.shape[-1],)
    if summed.dtype == x.dtype == weight.dtype and (bias is None or bias.dtype == weight.dtype):
        return F.layer_norm(summed, shape, weight, bias, eps), summed  # fp32 statistics, one rounding
    bias32 = None if bias is None else bias.float()
    return F.layer_norm(summed.float(), shape, weight.float(), bias32, eps).to(x.dtype), summed
