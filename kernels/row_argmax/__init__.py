"""Greedy token choice: the first index of each row's maximum (``torch.argmax(logits, dim=-1)`` semantics).

``row_argmax_cpu.cpp`` is a fused C++ kernel for fp32 CPU logits with rows or columns contiguous (see
:mod:`rnnserve.kernels.cpu_extension`); everything else uses ``torch.argmax``, the reference the tests compare
against. On a row containing NaN the kernel still returns a valid index, not necessarily the NaN's.
"""

from __future__ import annotations

import torch

from rnnserve.kernels.cpu_extension import use_cpu_kernel

MIN_FUSED_VOCAB = 1024  # below this, torch.argmax is as fast


def row_argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits [R, V]`` -> int64 ``[R]``: the first position of each row's maximum."""
    fused = (
        logits.dim() == 2
        and logits.dtype == torch.float32
        and logits.shape[1] >= MIN_FUSED_VOCAB
        and 1 in logits.stride()
        and use_cpu_kernel(logits)
    )
    return torch.ops.rnnserve.row_argmax(logits) if fused else logits.argmax(dim=-1)


__all__ = ["row_argmax"]
