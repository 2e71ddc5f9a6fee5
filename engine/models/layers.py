"""Small building blocks shared by the model modules."""

from __future__ import annotations

import torch
from torch import nn

SMALL_BATCH_ROWS = 128


def linear(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``layer(x)``, computed on CPU as ``(W @ x^T)^T`` for 2..128 rows (decode batches, small prefill chunks).

    With few rows, MKL/oneDNN repack the weight for ``x @ W^T`` on every call; ``W @ x^T`` streams it as
    stored instead: 1.4-1.8x faster in fp32 and 1.5-2.5x in bf16 (AMX) at 8-64 rows on these CPUs. The
    result is a transposed view.
    """
    rows = x.shape[0]
    if x.device.type != "cpu" or x.dim() != 2 or not 2 <= rows <= SMALL_BATCH_ROWS:
        return layer(x)
    out = torch.mm(layer.weight, x.t()).t()
    return out if layer.bias is None else out + layer.bias
