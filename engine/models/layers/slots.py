"""Reading and writing sequences' rows of the state pool."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def gather_slots(pools: Sequence[torch.Tensor], slot_ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Copies of rows ``slot_ids`` of each pool tensor (or per-layer view such as ``state["h"][:, layer]``)."""
    return tuple(pool[slot_ids] for pool in pools)


def scatter_slots(pools: Sequence[torch.Tensor], slot_ids: torch.Tensor, values: Sequence[torch.Tensor]) -> None:
    """Write ``values`` back to rows ``slot_ids`` of the matching pools, in each pool's dtype."""
    for pool, value in zip(pools, values, strict=True):
        pool[slot_ids] = value.to(pool.dtype)


def slot_index(slot_ids: torch.Tensor) -> torch.Tensor | slice:
    """``slot_ids`` as a ``slice`` when they are consecutive (pool rows are then views, updated in place).

    Checked on CPU only: on an accelerator the comparison would synchronise the device.
    """
    n = slot_ids.numel()
    if slot_ids.device.type != "cpu" or n == 0:
        return slot_ids
    first = int(slot_ids[0])
    if torch.equal(slot_ids, torch.arange(first, first + n, dtype=slot_ids.dtype)):
        return slice(first, first + n)
    return slot_ids
