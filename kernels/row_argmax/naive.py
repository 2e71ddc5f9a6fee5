"""PyTorch reference for greedy token choice: ``torch.argmax`` over the last dimension."""

from __future__ import annotations

import torch


def row_argmax_ref(logits: torch.Tensor) -> torch.Tensor:
    """``logits [R, V]`` -> int64 ``[R]``: the first position of each row's maximum (a NaN counts as the
    maximum, as in ``torch.argmax``)."""
    return logits.argmax(dim=-1)
