"""Shared cases for the kernel tests: ragged packed batches and out-of-order slot ids."""

from __future__ import annotations

import torch

# Lengths 1..67: single tokens, multiples of the chunk sizes under test (16, 32, 64) and odd remainders.
LENGTHS = [5, 1, 67, 16, 33, 2, 64]


def cu_seqlens_of(lengths: list[int], device: str | torch.device = "cpu") -> torch.Tensor:
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    return torch.tensor(offsets, dtype=torch.int64, device=device)


def slot_ids_for(batch: int, num_slots: int, seed: int = 0) -> torch.Tensor:
    """Distinct slots out of order with gaps (``num_slots`` > ``batch``)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randperm(num_slots, generator=gen)[:batch]
