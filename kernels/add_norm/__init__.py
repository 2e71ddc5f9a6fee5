"""LayerNorm / RMSNorm fused with the residual add of a pre-norm block.

``naive.py`` holds the PyTorch references, ``fused.py`` the Triton kernel of :func:`add_norm` (one program
per row), ``add_norm_cpu.cpp`` the CPU kernel of :func:`residual_rms_norm` (see :mod:`rnnserve.kernels.cpu_extension`).
"""

from __future__ import annotations

import torch

from rnnserve.kernels.add_norm.naive import add_norm_ref, residual_rms_norm_ref
from rnnserve.kernels.backend import use_triton
from rnnserve.kernels.cpu_extension import use_cpu_kernel


def add_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    rms: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``r = residual + x`` (or ``x``); returns ``(norm(r) * weight + bias, r)`` in ``x``'s dtype.

    LayerNorm over the last dimension, or RMSNorm when ``rms``. The second output is the new residual
    stream, so consecutive blocks chain ``normed, stream = add_norm(delta, stream, ...)``.
    """
    if use_triton(x):
        from rnnserve.kernels.add_norm.fused import add_norm_triton

        return add_norm_triton(x, residual, weight, bias, eps, rms)
    return add_norm_ref(x, residual, weight, bias, eps, rms)


def residual_rms_norm(
    stream: torch.Tensor,
    delta: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    round_to_weight_dtype: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mamba's ``new_stream = stream + delta`` then RMSNorm, with the reference's rounding steps.

    See :func:`~rnnserve.kernels.add_norm.naive.residual_rms_norm_ref` for the exact semantics; 2-D CPU tensors (the
    stream's rows contiguous) run the fused C++ kernel. Returns ``(normed, new_stream)``.
    """
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


__all__ = ["add_norm", "add_norm_ref", "residual_rms_norm", "residual_rms_norm_ref"]
