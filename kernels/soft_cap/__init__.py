"""Logit soft-capping, ``cap * tanh(logits / cap)``: ``soft_cap`` from the LM head's output to fp32 logits,
``soft_cap_`` in place on fp32 logits.

``naive.py`` is the reference. ``fused.py`` is the GPU kernel (conversion and cap in one pass).
``soft_cap_cpu.cpp`` does it in one pass over the logits on CPU: the three ATen ops took ~20 ms a step for 32 rows
of a 256K vocabulary on a 2-core Zen 5 (ATen's fp32 ``tanh`` alone 13.5 ms, five times its ``exp``), a sixth of a
bf16 ``hawk-100m`` decode step. Its tanh is ``(1 - e) / (1 + e)`` with ``e = exp(-2|t|)`` (the shared
``fast_exp``), and a Taylor polynomial below ``|t| = 1/8``: within a few fp32 units of the last place, relative,
like ATen's. As in the reference, infinities become ``±cap`` and NaN stays NaN.
"""

from __future__ import annotations

import torch

from rnnserve.kernels.backend import use_triton
from rnnserve.kernels.cpu_extension import use_cpu_kernel
from rnnserve.kernels.soft_cap.naive import soft_cap_ref


def _dense(logits: torch.Tensor) -> bool:
    """Rows or, as a ``W @ x^T`` LM head returns them, columns contiguous: the kernels walk memory in order."""
    return logits.is_contiguous() or (logits.dim() == 2 and logits.t().is_contiguous())


def soft_cap_(logits: torch.Tensor, cap: float) -> torch.Tensor:
    """Cap ``logits`` (fp32) in place and return them: one fused pass on CPU where the kernel applies (rows or,
    as a ``W @ x^T`` LM head returns them, columns contiguous), else the reference's result copied in."""
    if logits.dtype == torch.float32 and _dense(logits) and use_cpu_kernel(logits):
        return torch.ops.rnnserve.soft_cap_(logits, cap)
    return logits.copy_(soft_cap_ref(logits, cap))


def soft_cap(logits: torch.Tensor, cap: float) -> torch.Tensor:
    """``cap * tanh(logits / cap)`` as fp32 logits, from logits in any float dtype: one Triton pass on a GPU where
    they are dense, else their fp32 form (the tensor itself when already fp32) capped in place by :func:`soft_cap_`."""
    if use_triton(logits) and _dense(logits):
        from rnnserve.kernels.soft_cap.fused import soft_cap_triton

        return soft_cap_triton(logits, cap)
    return soft_cap_(logits.float(), cap)


__all__ = ["soft_cap", "soft_cap_"]
