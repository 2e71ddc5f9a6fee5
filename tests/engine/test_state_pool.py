"""State pool: allocation, reset to non-zero initial values, fork, scratch slot, sizing."""

from __future__ import annotations

import pytest
import torch

from rnnserve.engine.models.base import StateSpec
from rnnserve.engine.state_pool import OutOfSlotsError, StatePool

SPECS = [
    StateSpec("ring", (4, 3), torch.float32, 0.0),
    StateSpec("counter", (), torch.int64, 0),
    StateSpec("s0", (2, 2), torch.float64, torch.eye(2, dtype=torch.float64)),
    StateSpec("half", (5,), torch.bfloat16, 1.5),
]


def test_bytes_per_slot_is_the_analytic_size() -> None:
    pool = StatePool(SPECS, 3)
    assert pool.bytes_per_slot == 12 * 4 + 8 + 4 * 8 + 5 * 2
    assert pool.total_bytes == 3 * pool.bytes_per_slot
    assert pool.tensors["ring"].shape == (4, 4, 3)  # 3 slots + scratch


def test_allocate_resets_to_initial_and_free_recycles() -> None:
    pool = StatePool(SPECS, 2)
    (slot,) = pool.allocate()
    pool.tensors["s0"][slot] = 7.0
    pool.tensors["counter"][slot] = 42
    pool.free([slot])
    again = pool.allocate(2)
    assert slot in again
    assert torch.equal(pool.tensors["s0"][slot], torch.eye(2, dtype=torch.float64))
    assert int(pool.tensors["counter"][slot]) == 0
    assert torch.all(pool.tensors["half"][slot] == 1.5)
    with pytest.raises(OutOfSlotsError):
        pool.allocate()
    with pytest.raises(ValueError):
        pool.free([5])


def test_allocate_many_resets_every_slot_it_takes_or_takes_none() -> None:
    pool = StatePool(SPECS, 5)
    used = pool.allocate(5)
    for slot in used:
        pool.tensors["s0"][slot] = 7.0
        pool.tensors["counter"][slot] = 42
    pool.free(used)
    with pytest.raises(OutOfSlotsError):
        pool.allocate_many([2, 4])
    assert pool.num_free == 5  # nothing was taken
    taken = pool.allocate_many([2, 1, 2])
    assert [len(slots) for slots in taken] == [2, 1, 2]
    assert sorted(slot for slots in taken for slot in slots) == sorted(used)
    for slot in used:
        assert torch.equal(pool.tensors["s0"][slot], torch.eye(2, dtype=torch.float64))
        assert int(pool.tensors["counter"][slot]) == 0
    assert pool.num_free == 0


def test_double_free_is_an_error() -> None:
    pool = StatePool(SPECS, 2)
    slots = pool.allocate()
    pool.free(slots)
    with pytest.raises(ValueError):
        pool.free(slots)


def test_copy_forks_one_slot_into_many() -> None:
    pool = StatePool(SPECS, 4)
    src, *dst = pool.allocate(4)
    pool.tensors["ring"][src] = torch.arange(12.0).view(4, 3)
    pool.copy(src, dst)
    for d in dst:
        assert torch.equal(pool.tensors["ring"][d], pool.tensors["ring"][src])


def test_from_budget_takes_the_smaller_limit() -> None:
    per_slot = StatePool(SPECS, 1).bytes_per_slot
    assert StatePool.from_budget(SPECS, max_num_seqs=10, state_memory=per_slot * 4).num_slots == 3
    assert StatePool.from_budget(SPECS, max_num_seqs=3, state_memory=per_slot * 40).num_slots == 3
    assert StatePool.from_budget(SPECS, state_memory=per_slot * 7 + 1).num_slots == 6
    with pytest.raises(ValueError):
        StatePool.from_budget(SPECS)


def test_rejects_bad_specs() -> None:
    with pytest.raises(ValueError):
        StatePool([StateSpec("a", (2,), torch.float32), StateSpec("a", (2,), torch.float32)], 1)
    with pytest.raises(ValueError):
        StatePool([StateSpec("a", (2,), torch.float32, torch.zeros(3))], 1)
