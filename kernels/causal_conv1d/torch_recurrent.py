"""Causal conv1d decode update on a state pool in PyTorch (the path when neither Triton nor the C++ kernel
applies).

The reference's math with one multiply-add per tap (no reduction over the short tap axis) and one
``index_copy_`` back into the pool: about 2x faster on CPU than gathering a window and scattering through
advanced indexing.
"""

from __future__ import annotations

import torch


def causal_conv1d_update_torch(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    slot_ids: torch.Tensor,
) -> torch.Tensor:
    """``x [B, C]``; ``conv_state [N, C, K-1]`` updated in place at rows ``slot_ids`` -> ``y [B, C]``."""
    tail = conv_state[slot_ids].float()
    w = weight.float()
    width = w.shape[1]
    x32 = x.float()
    y = x32 * w[:, width - 1]
    if bias is not None:
        y = y + bias.float()
    for tap in range(width - 1):
        y.addcmul_(tail[:, :, tap], w[:, tap])
    shifted = torch.cat([tail, x32[:, :, None]], dim=2)[:, :, 1:]  # the last K-1 inputs (none for width 1)
    conv_state.index_copy_(0, slot_ids, shifted.to(conv_state.dtype))
    return y.to(x.dtype)
