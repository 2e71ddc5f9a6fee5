"""PyTorch reference for the residual add + RMSNorm of a Hugging Face Mamba / Mamba-2 block."""

from __future__ import annotations

import torch


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps)`` over the last dimension, computed and returned in fp32."""
    x32 = x.float()
    return x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)


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
