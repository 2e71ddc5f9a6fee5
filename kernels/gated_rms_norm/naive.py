"""PyTorch reference for Mamba-2's gated group RMSNorm, ``RMSNorm(y * silu(z))`` with per-group statistics."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rnnserve.kernels.residual_rms_norm.naive import rms_normalize


def gated_rms_norm_ref(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, groups: int, eps: float) -> torch.Tensor:
    """``weight * rms_normalize(y * silu(z))`` over ``groups`` equal slices of the last dimension.

    Rounding steps: ``y * silu(z)`` and the statistics in fp32; the normalised value rounded to ``z``'s dtype
    (the activation dtype); its product with ``weight`` rounded once to ``torch.promote_types(weight.dtype,
    z.dtype)``, which is ``z``'s dtype when the weight shares it.
    """
    gated = (y.float() * F.silu(z.float())).unflatten(-1, (groups, -1))
    return weight * rms_normalize(gated, eps).flatten(-2).to(z.dtype)
