"""One Mamba-1 mixer decode step as a single fused CPU op (``mamba_decode_cpu.cpp``).

The op chains the CPU kernels of ``skinny_linear``, ``causal_conv1d`` and ``selective_scan`` (and ATen GEMMs,
chosen as :func:`rnnserve.engine.models.layers.matmul_t` chooses them) without returning to Python between them. Its
reference is the unfused step of :class:`rnnserve.engine.models.mamba.MambaMixer`, which the tests compare it with.
"""

from __future__ import annotations

import torch

from rnnserve.kernels.cpu_extension import use_cpu_kernel

MAX_STATE = 64  # the fused selective-scan kernel's d_state limit


def fused_mixer_decode_applies(h: torch.Tensor, conv_pool: torch.Tensor, ssm_pool: torch.Tensor) -> bool:
    """Whether a decode step on ``h [B, d_model]`` with these pool views can run as one fused op (which has no
    autograd formula: only with gradients off, as the engine runs)."""
    d_state = ssm_pool.shape[-1]
    return (
        h.dim() == 2
        and h.dtype in (torch.float32, torch.bfloat16)
        and conv_pool.dtype == torch.float32
        and conv_pool.stride(-1) == 1
        and ssm_pool.dtype == torch.float32
        and ssm_pool.stride(-1) == 1
        and ssm_pool.stride(-2) == d_state
        and d_state <= MAX_STATE
        and not torch.is_grad_enabled()
        and use_cpu_kernel(h)
    )


__all__ = ["fused_mixer_decode_applies"]
