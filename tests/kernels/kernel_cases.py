"""Shared cases for the kernel tests: ragged packed batches, out-of-order slot ids, and call counting."""

from __future__ import annotations

import importlib

import pytest
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


def count_calls(monkeypatch: pytest.MonkeyPatch, wrappers: list[tuple[str, str]]) -> dict[str, int]:
    """Wrap each ``(module, function)`` so its calls are counted, to prove a model really ran those kernels."""
    calls = {name: 0 for _, name in wrappers}
    for module_name, name in wrappers:
        module = importlib.import_module(module_name)
        original = getattr(module, name)

        def spy(*args, _original=original, _name=name, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(module, name, spy)
    return calls
