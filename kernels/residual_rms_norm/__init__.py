"""The residual add + RMSNorm of a Mamba / Mamba-2 block, with the Hugging Face blocks' rounding steps.

``naive.py`` holds the PyTorch reference, ``fused.py`` the Triton kernel (GPUs; one program per row) and
``residual_rms_norm_cpu.cpp`` the fused C++ kernel (one pass per row, see :mod:`rnnserve.kernels.cpu_extension`).
"""

from __future__ import annotations

import torch

from rnnserve.kernels.backend import use_triton
from rnnserve.kernels.cpu_extension import use_cpu_kernel
from rnnserve.kernels.residual_rms_norm.naive import residual_rms_norm_ref


def residual_rms_norm(
    stream: torch.Tensor,
    delta: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    round_to_weight_dtype: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mamba's ``new_stream = stream + delta`` then RMSNorm; returns ``(normed, new_stream)``.

    See :func:`~rnnserve.kernels.residual_rms_norm.naive.residual_rms_norm_ref` for the exact semantics; GPU
    tensors run the Triton kernel, 2-D CPU tensors (the stream's rows contiguous) the fused C++ kernel.
    """
    if use_triton(stream):
        from rnnserve.kernels.residual_rms_norm.fused import residual_rms_norm_triton

        return residual_rms_norm_triton(stream, delta, weight, eps, round_to_weight_dtype)
    fused = (
        stream.dim() == 2
        and stream.stride(1) == 1
        and weight.dtype in (torch.float32, torch.bfloat16)
        and stream.dtype in (torch.float32, weight.dtype)
        and (delta is None or delta.dtype == weight.dtype)
        and use_cpu_kernel(stream)
    )
    if not fused:
        return residual_rms_norm_ref(stream, delta, weight, eps, round_to_weight_dtype)
    normed, new_stream = torch.ops.rnnserve.residual_rms_norm(
        stream, delta, weight.contiguous(), eps, round_to_weight_dtype
    )
    return normed, stream if delta is None else new_stream


__all__ = ["residual_rms_norm"]
