"""LayerNorm / RMSNorm fused with the residual add of a pre-norm block (minGRU / minLSTM).

``naive.py`` holds the PyTorch reference and ``fused.py`` the Triton kernel (one program per row). Mamba's
residual add + RMSNorm, with the Hugging Face blocks' rounding steps, is :mod:`rnnserve.kernels.residual_rms_norm`.
"""

from __future__ import annotations

import torch

from rnnserve.kernels.add_norm.naive import add_norm_ref
from rnnserve.kernels.backend import use_triton


def add_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    rms: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``r = residual + x`` (or ``x``); returns ``(norm(r) * weight + bias, r)``: the first in ``x``'s dtype,
    ``r`` in the promoted dtype of ``x`` and ``residual`` (an fp32 residual stream stays fp32).

    LayerNorm over the last dimension, or RMSNorm when ``rms``. The second output is the new residual
    stream, so consecutive blocks chain ``normed, stream = add_norm(delta, stream, ...)``.
    """
    if use_triton(x):
        from rnnserve.kernels.add_norm.fused import add_norm_triton

        return add_norm_triton(x, residual, weight, bias, eps, rms)
    return add_norm_ref(x, residual, weight, bias, eps, rms)


__all__ = ["add_norm"]
