"""Choose between a Triton kernel and its PyTorch reference.

Public kernel functions run Triton when their tensors live on a CUDA device and the reference elsewhere.
Tests force Triton on CPU tensors (under ``TRITON_INTERPRET=1``) with :func:`force_triton`.
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator

import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None
_forced: bool | None = None


def use_triton(x: torch.Tensor) -> bool:
    """True when ``x``'s op should run the Triton kernel."""
    if _forced is not None:
        return _forced
    return HAS_TRITON and x.is_cuda


@contextlib.contextmanager
def force_triton(enabled: bool = True) -> Iterator[None]:
    """Within the block, every public kernel function uses Triton (``True``) or the reference (``False``)."""
    global _forced
    if enabled and not HAS_TRITON:
        raise RuntimeError("force_triton(True) needs the triton package")
    previous, _forced = _forced, enabled
    try:
        yield
    finally:
        _forced = previous


def unit_stride_last(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when its last dimension is contiguous (rows may be strided, e.g. a split of a projection),
    else a contiguous copy: the layout the Triton kernels index."""
    return t if t.stride(-1) == 1 else t.contiguous()
