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


def residual_rms_norm_ref(
    stream: torch.Tensor,
    delta: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    round_to_weight_dtype: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and RMSNorm of a Hugging Face Mamba / Mamba-2 block, rounding step by rounding step.

    ``new_stream = stream + delta`` in ``stream``'s dtype (fp32 for ``residual_in_fp32`` models; ``stream``
    itself when ``delta`` is None). The norm's input is ``new_stream`` converted to ``weight``'s dtype when
    ``round_to_weight_dtype`` (a block's norm), or as it is (the final norm); statistics are fp32, the
    normalised value is rounded back to that input dtype and multiplied by ``weight``. Returns
    ``(normed in weight's dtype, new_stream)``.
    """
    new_stream = stream if delta is None else stream + delta.to(stream.dtype)
    x = new_stream.to(weight.dtype) if round_to_weight_dtype else new_stream
    x32 = x.float()
    y = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (weight * y).to(weight.dtype), new_stream
