"""Choose between a Triton kernel and its PyTorch reference.

Public kernel functions run Triton when their tensors live on a CUDA device and the reference elsewhere.
Tests force Triton on CPU tensors (under ``TRITON_INTERPRET=1``) with :func:`force_triton`.
"""

from __future__ import annotations

import array
import contextlib
import importlib.util
from collections.abc import Callable, Hashable, Iterator
from typing import TypeVar

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


def on_pool_rows(
    scan: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]], pool: torch.Tensor, slot_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``scan(initial_state) -> (y, final_state)`` on rows ``slot_ids`` of a state pool, the final states written
    back in place: ``(y, pool)``. The copy-based form of the prefill kernels' slot addressing, for the paths
    without it."""
    y, final = scan(pool[slot_ids])
    pool[slot_ids] = final.to(pool.dtype)
    return y, pool


def slot_tensor(slots: torch.Tensor | slice, pool: torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
    """``slots`` (rows of ``pool``) as an int64 tensor: a slice's rows as ``pool[slots]`` takes them (its step
    and open ends included)."""
    if isinstance(slots, slice):
        return torch.arange(*slots.indices(pool.shape[0]), device=device)
    return slots


T = TypeVar("T")
_TABLES_ATTR = "_rnnserve_host_tables"
_BOUNDS = object()  # the key of the host copy of cu_seqlens itself


def int64_table(values: list[int] | torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """Host ints (a list or a CPU tensor) as an int64 tensor on ``device``, copied without waiting for the
    device (a blocking copy would wait for every kernel queued before it). A list goes through an ``array`` of
    int64 (a third of the time ``torch.as_tensor`` takes to read Python ints one by one)."""
    if isinstance(values, torch.Tensor) or not values:
        host = torch.as_tensor(values, dtype=torch.int64)
    else:
        host = torch.frombuffer(array.array("q", values), dtype=torch.int64)
    if torch.device(device).type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def _version(t: torch.Tensor) -> int:
    """``t``'s in-place change counter; inference tensors have none and count as never changed."""
    return -1 if t.is_inference() else t._version


def with_host_bounds(cu_seqlens: torch.Tensor, bounds: list[int]) -> torch.Tensor:
    """``cu_seqlens`` with ``bounds`` (the host values it was copied from) attached as its host copy, so that
    :func:`per_cu_seqlens` never reads it back: a batch built on the host then never waits for the device."""
    setattr(cu_seqlens, _TABLES_ATTR, (_version(cu_seqlens), {_BOUNDS: list(bounds)}))
    return cu_seqlens


def per_cu_seqlens(cu_seqlens: torch.Tensor, key: Hashable, build: Callable[[list[int]], T]) -> T:
    """``build(cu_seqlens.tolist())``, computed once per ``cu_seqlens`` tensor and ``key``.

    A model's layers all receive the same ``cu_seqlens`` tensor, so the prefill kernels that need the lengths
    on the host (to lay out chunks or segments) read them once per batch instead of once per layer: every read
    waits for the device to drain its queue. The result lives on the tensor (and dies with it); an in-place
    change of a normal tensor (a new version) rebuilds it. Inference tensors have no version counter: they
    are taken as unchanged (the engine builds a new ``cu_seqlens`` per batch)."""
    version = _version(cu_seqlens)
    cache = getattr(cu_seqlens, _TABLES_ATTR, None)
    if cache is None or cache[0] != version:
        cache = (version, {})
        setattr(cu_seqlens, _TABLES_ATTR, cache)
    tables = cache[1]
    if key not in tables:
        if _BOUNDS not in tables:
            tables[_BOUNDS] = cu_seqlens.tolist()
        tables[key] = build(tables[_BOUNDS])
    return tables[key]
