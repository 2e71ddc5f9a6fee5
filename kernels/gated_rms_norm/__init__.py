"""Mamba-2's gated group RMSNorm, ``weight * RMSNorm(y * silu(z))`` with statistics per group of channels.

``naive.py`` holds the PyTorch reference (the model's op-by-op norm), ``fused.py`` the Triton kernel (GPUs;
one program per row and group) and ``gated_rms_norm_cpu.cpp`` the CPU kernel (one pass per row and group, the
reference's roundings).
"""

from __future__ import annotations

import torch

from rnnserve.kernels.backend import use_triton
from rnnserve.kernels.cpu_extension import use_cpu_kernel
from rnnserve.kernels.gated_rms_norm.naive import gated_rms_norm_ref


def _cpu_op_applies(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor) -> bool:
    return (
        y.dim() == 2
        and y.shape == z.shape
        and y.dtype == torch.float32
        and z.dtype in (torch.float32, torch.bfloat16)
        and weight.dtype == z.dtype
        and y.stride(-1) == 1
        and z.stride(-1) == 1
        and not torch.is_grad_enabled()
        and use_cpu_kernel(z)
    )


def gated_rms_norm(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, groups: int, eps: float) -> torch.Tensor:
    """``y, z [..., D]``, ``weight [D]`` -> the normalised ``[..., D]`` in ``promote_types(weight.dtype,
    z.dtype)``; see :func:`~rnnserve.kernels.gated_rms_norm.naive.gated_rms_norm_ref` for the rounding steps.
    GPU tensors run the Triton kernel, CPU tensors the C++ kernel where it applies (fp32 ``y`` and rows of ``z``
    and the weight in one dtype), others the reference."""
    if use_triton(z):
        from rnnserve.kernels.gated_rms_norm.fused import gated_rms_norm_triton

        return gated_rms_norm_triton(y, z, weight, groups, eps)
    if _cpu_op_applies(y, z, weight):
        return torch.ops.rnnserve.gated_rms_norm(y, z, weight.contiguous(), groups, eps)
    return gated_rms_norm_ref(y, z, weight, groups, eps)


__all__ = ["gated_rms_norm"]
