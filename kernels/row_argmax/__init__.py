"""Greedy token choice: the first index of each row's maximum (``torch.argmax(logits, dim=-1)`` semantics).

``naive.py`` is the reference (``torch.argmax``); ``row_argmax_cpu.cpp`` a fused C++ kernel for fp32 CPU
logits with rows or columns contiguous (see :mod:`rnnserve.kernels.cpu_extension`). Both take a NaN as the
maximum (a row's first NaN is its answer) and a row of ``-inf`` gives 0.
"""

from __future__ import annotations

import torch

from rnnserve.kernels.cpu_extension import use_cpu_kernel
from rnnserve.kernels.row_argmax.naive import row_argmax_ref


def row_argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits [R, V]`` -> int64 ``[R]``: the first position of each row's maximum."""
    fused = (
        logits.dim() == 2
        and logits.dtype == torch.float32
        and 1 in logits.stride()
        and use_cpu_kernel(logits)
    )
    return torch.ops.rnnserve.row_argmax(logits) if fused else row_argmax_ref(logits)


__all__ = ["row_argmax"]
