"""Mamba-2's gated group RMSNorm, ``weight * RMSNorm(y * silu(z))`` with statistics per group of channels.

``naive.py`` holds the PyTorch reference (the model's op-by-op norm) and ``fused.py`` the Triton kernel (GPUs;
one program per row and group).
"""

from __future__ import annotations

import torch

from rnnserve.kernels.backend import use_triton
from rnnserve.kernels.gated_rms_norm.naive import gated_rms_norm_ref


def gated_rms_norm(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, groups: int, eps: float) -> torch.Tensor:
    """``y, z [..., D]``, ``weight [D]`` -> the normalised ``[..., D]`` in ``promote_types(weight.dtype,
    z.dtype)``; see :func:`~rnnserve.kernels.gated_rms_norm.naive.gated_rms_norm_ref` for the rounding steps.
    GPU tensors run the Triton kernel, others the reference."""
    if use_triton(z):
        from rnnserve.kernels.gated_rms_norm.fused import gated_rms_norm_triton

        return gated_rms_norm_triton(y, z, weight, groups, eps)
    return gated_rms_norm_ref(y, z, weight, groups, eps)


__all__ = ["gated_rms_norm"]
