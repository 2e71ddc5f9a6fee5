"""Logit soft-capping, ``cap * tanh(logits / cap)``, in place on fp32 logits.

``naive.py`` is the reference. ``soft_cap_cpu.cpp`` does it in one pass over the logits on CPU: the three ATen
ops took ~20 ms a step for 32 rows of a 256K vocabulary on a 2-core Zen 5 (ATen's fp32 ``tanh`` alone 13.5 ms,
five times its ``exp``), a sixth of a bf16 ``hawk-100m`` decode step. Its tanh is ``(1 - e) / (1 + e)`` with
``e = exp(-2|t|)`` (the shared ``fast_exp``), and a Taylor polynomial below ``|t| = 1/8``: within a few fp32 units
of the last place, relative, like ATen's.
"""

from __future__ import annotations

import torch

from rnnserve.kernels.cpu_extension import use_cpu_kernel
from rnnserve.kernels.soft_cap.naive import soft_cap_ref


def soft_cap_(logits: torch.Tensor, cap: float) -> torch.Tensor:
    """Cap ``logits`` (fp32) in place and return them: one fused pass on CPU where the kernel applies (rows or,
    as a ``W @ x^T`` LM head returns them, columns contiguous), else the reference's result copied in."""
    dense = logits.is_contiguous() or (logits.dim() == 2 and logits.t().is_contiguous())
    if logits.dtype == torch.float32 and dense and use_cpu_kernel(logits):
        return torch.ops.rnnserve.soft_cap_(logits, cap)
    return logits.copy_(soft_cap_ref(logits, cap))


__all__ = ["soft_cap_"]
