"""A persistent Triton decode step of a whole Mamba-1 stack: one launch a step instead of three kernels a layer.

Helpers any persistent decode stack shares (the Mamba-2 stack's too): :func:`pointer_table`, the per-layer
addresses a kernel loads from memory (cached, so that a CUDA graph capture finds the table built), and
:func:`persistent_grid`, the grid a launch whose programs meet at
:func:`~rnnserve.kernels.mamba_decode.fused_recurrent.grid_barrier` may have.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch

POINTER_ALIGNMENT = 16  # bytes: the kernels tell the compiler each table address is a multiple (16-byte loads)
TABLE_CACHE_SIZE = 16  # tables kept (a table per model and device; tests build many)
_tables: OrderedDict[tuple, torch.Tensor] = OrderedDict()


def pointer_table(columns: Sequence[Sequence[torch.Tensor]]) -> torch.Tensor:
    """The addresses of ``columns[f][i]`` (field ``f`` of layer ``i``) as an int64 ``[fields, layers]`` tensor on
    the tensors' device, for a kernel to load a layer's pointers from (``tl.load(...).to(tl.pointer_type(...))``).

    Built once per set of tensors (keyed on their addresses, shapes and dtypes; the last
    :data:`TABLE_CACHE_SIZE` kept): building one is a host-to-device copy, which a CUDA graph capture cannot do,
    so a step captured after an eager one with the same weights finds its table here. Every tensor must be
    contiguous and start on a :data:`POINTER_ALIGNMENT`-byte boundary (the kernels rely on both).
    """
    tensors = [t for column in columns for t in column]
    device = tensors[0].device
    key = (device, len(columns), *((t.data_ptr(), tuple(t.shape), t.dtype) for t in tensors))
    table = _tables.get(key)
    if table is not None:
        _tables.move_to_end(key)
        return table
    for t in tensors:
        if t.device != device or not t.is_contiguous() or t.data_ptr() % POINTER_ALIGNMENT:
            raise ValueError(f"a pointer table takes contiguous tensors on one device at {POINTER_ALIGNMENT}-byte "
                             f"boundaries, got one of shape {tuple(t.shape)} on {t.device} at {t.data_ptr():#x}")
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("a persistent decode stack's pointer table is built on its first eager call; run one "
                           "step with these weights before capturing a CUDA graph")
    addresses = [[t.data_ptr() for t in column] for column in columns]
    table = torch.tensor(addresses, dtype=torch.int64).to(device)
    _tables[key] = table
    while len(_tables) > TABLE_CACHE_SIZE:
        _tables.popitem(last=False)
    return table


def persistent_grid(device: torch.device, max_items: int) -> int:
    """Programs of a persistent launch whose phases have at most ``max_items`` work items: one per SM of
    ``device`` at most, so that all are resident at once as a grid barrier needs (each must fit an SM alone), and
    no more than the largest phase has items for. One under the interpreter, which runs programs one after another
    (a barrier passes at once only for a single program)."""
    if device.type != "cuda":
        return 1
    return max(1, min(_sm_count(device.index), max_items))


def _sm_count(index: int | None) -> int:
    return torch.cuda.get_device_properties(index if index is not None else torch.cuda.current_device()
                                            ).multi_processor_count


__all__ = ["pointer_table", "persistent_grid"]
