"""``F.linear`` for a few bf16 rows (a decode batch), reading the weight at memory speed on CPUs with AMX.

``naive.py`` is the reference, ``F.linear``. ``skinny_linear_cpu.cpp`` multiplies 16-row blocks of the weight,
as stored, with tiles repacked from ``x``; it applies to bf16 ``x [M, K]`` with 1 to :data:`MAX_ROWS` rows and
a bf16 weight, both with a unit stride along ``K``, on CPUs with AMX-BF16 (Sapphire Rapids and later).
Everything else runs the reference.
"""

from __future__ import annotations

import torch

from rnnserve.kernels.cpu_extension import cpu_ops, use_cpu_kernel
from rnnserve.kernels.skinny_linear.naive import skinny_linear_ref

MAX_ROWS = 32

_available: bool | None = None


def amx_available() -> bool:
    """True when the fused kernels are built with AMX-BF16 and the OS lets this process use its tiles."""
    global _available
    if _available is None:
        _available = cpu_ops() and bool(torch.ops.rnnserve.skinny_linear_available())
    return _available


def skinny_linear_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`skinny_linear` runs the AMX kernel for these operands. (The CPU is asked right after the
    device: on one without AMX the other checks cost ~1.7 us a linear layer, a third of ``matmul_t``'s own time
    at batch 1.)"""
    return (
        x.is_cpu
        and amx_available()
        and x.dtype == torch.bfloat16
        and weight.dtype == torch.bfloat16
        and x.dim() == 2
        and 1 <= x.shape[0] <= MAX_ROWS
        and x.stride(1) == 1
        and weight.stride(1) == 1
        and weight.is_cpu
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
        and use_cpu_kernel(x)
    )


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias``: the AMX kernel where :func:`skinny_linear_applies`, else the reference.

    The kernel accumulates in fp32 and rounds once; it returns a contiguous ``[M, N]`` tensor.
    """
    if skinny_linear_applies(x, weight):
        return torch.ops.rnnserve.skinny_linear(x, weight, bias)
    return skinny_linear_ref(x, weight, bias)


__all__ = ["MAX_ROWS", "amx_available", "skinny_linear", "skinny_linear_applies"]
