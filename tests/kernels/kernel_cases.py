"""Shared cases for the kernel tests: ragged packed batches, out-of-order slot ids, and call counting."""

from __future__ import annotations

import importlib

import pytest
import torch

from rnnserve.engine.models.base import RecurrentLM
from rnnserve.engine.state_pool import StatePool

# Lengths 1..67: single tokens, multiples of the chunk sizes under test (16, 32, 64) and odd remainders.
LENGTHS = [5, 1, 67, 16, 33, 2, 64]


def cu_seqlens_of(lengths: list[int], device: str | torch.device = "cpu") -> torch.Tensor:
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    return torch.tensor(offsets, dtype=torch.int64, device=device)


def assert_other_rows_untouched(pool: torch.Tensor, before: torch.Tensor, slots: torch.Tensor, layer: int) -> None:
    """``pool [slots, layers, ...]`` equals ``before`` outside rows ``slots`` of layer ``layer``: a prefill on one
    layer's view wrote its sequences' slots and nothing else."""
    untouched = torch.ones(pool.shape[0], dtype=torch.bool)
    untouched[slots] = False
    other_layers = [i for i in range(pool.shape[1]) if i != layer]
    assert torch.equal(pool[untouched], before[untouched])
    assert torch.equal(pool[:, other_layers], before[:, other_layers])


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


def record_op_calls(monkeypatch: pytest.MonkeyPatch, namespace: object, name: str) -> list[object]:
    """Wrap the op ``namespace.name`` (e.g. ``torch.ops.rnnserve``) for the test; the returned list gets each
    call's last argument (a flag or a scale that tells the calls apart), to prove a public function ran it."""
    calls: list[object] = []
    op = getattr(namespace, name)

    def spy(*args: object) -> object:
        calls.append(args[-1])
        return op(*args)

    monkeypatch.setattr(namespace, name, spy)
    return calls


def twin_pools(model: RecurrentLM, num_slots: int, device: str | torch.device = "cpu") -> list[StatePool]:
    """Two state pools for ``model`` holding the same random non-zero states (one per path compared)."""
    pools = [StatePool(model.state_spec(), num_slots, device=device) for _ in range(2)]
    for pool in pools:
        for tensor in pool.tensors.values():
            tensor.copy_(torch.randn(tensor.shape, generator=torch.Generator().manual_seed(1)))
    return pools
