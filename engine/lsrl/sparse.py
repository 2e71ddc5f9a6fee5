"""Sparse fp64 matrices for LSRL programs and the compiler: small helpers over coalesced torch COO tensors.

Every matrix the language stores is a coalesced ``torch.sparse_coo_tensor`` of dtype float64 with explicit
zeros dropped; every vector is a dense float64 tensor. Compiled programs get wide (bypass lanes) but stay
very sparse, so nothing here ever densifies a matrix.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch

DTYPE = torch.float64


def from_coo(indices: torch.Tensor, values: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """A pruned sparse matrix from ``[2, nnz]`` indices and values (duplicates are summed)."""
    matrix = torch.sparse_coo_tensor(indices, values.to(DTYPE), shape, dtype=DTYPE, check_invariants=False).coalesce()
    keep = matrix.values() != 0
    if bool(keep.all()):
        return matrix
    return torch.sparse_coo_tensor(
        matrix.indices()[:, keep], matrix.values()[keep], shape, dtype=DTYPE, check_invariants=False
    ).coalesce()


def prune(matrix: torch.Tensor) -> torch.Tensor:
    """Coalesce and drop stored zeros (e.g. entries that cancelled in a product)."""
    matrix = matrix.coalesce()
    return from_coo(matrix.indices(), matrix.values(), tuple(matrix.shape))


def _numbers(value: Any) -> torch.Tensor:
    """``value`` as a dense fp64 tensor; a TypeError naming it when it holds something other than numbers."""
    try:
        return torch.as_tensor(value, dtype=DTYPE)
    except (TypeError, RuntimeError) as err:  # torch: "new(): invalid data type 'str'", "Could not infer dtype"
        raise TypeError(f"LSRL constants and matrices hold numbers, got {value!r:.80}") from err


def as_matrix(value: Any, shape: tuple[int, int] | None = None) -> torch.Tensor:
    """A 2-D matrix (nested lists, numpy array, dense or sparse tensor) as a pruned sparse fp64 tensor."""
    if isinstance(value, torch.Tensor) and value.is_sparse:
        matrix = prune(value.to(DTYPE))
    else:
        dense = _numbers(value)
        if dense.dim() != 2:
            raise ValueError(f"expected a 2-D matrix, got shape {tuple(dense.shape)}")
        matrix = prune(dense.to_sparse())
    if shape is not None and tuple(matrix.shape) != tuple(shape):
        raise ValueError(f"matrix has shape {tuple(matrix.shape)}, expected {tuple(shape)}")
    return matrix


def as_vector(value: Any, size: int) -> torch.Tensor:
    """A vector (``None`` = zeros, a scalar is broadcast, ``[n]`` or ``[n, 1]``) as a dense fp64 tensor."""
    if value is None:
        return torch.zeros(size, dtype=DTYPE)
    vector = _numbers(value)
    if vector.dim() == 0:
        return vector.expand(size).clone()
    vector = vector.reshape(-1)
    if vector.numel() != size:
        raise ValueError(f"vector has {vector.numel()} entries, expected {size}")
    return vector.clone()


def zeros(rows: int, cols: int) -> torch.Tensor:
    """An all-zero ``[rows, cols]`` sparse matrix."""
    return from_coo(torch.zeros(2, 0, dtype=torch.long), torch.zeros(0, dtype=DTYPE), (rows, cols))


def diagonal(values: torch.Tensor) -> torch.Tensor:
    """Square matrix with ``values`` on the diagonal."""
    index = torch.arange(values.numel())
    return from_coo(torch.stack([index, index]), values.reshape(-1), (values.numel(), values.numel()))


def identity(n: int, scale: float = 1.0) -> torch.Tensor:
    """The ``[n, n]`` identity times ``scale``, sparse."""
    return diagonal(torch.full((n,), scale, dtype=DTYPE))


def selection(columns: Sequence[int] | torch.Tensor, width: int) -> torch.Tensor:
    """Rows that pick ``columns`` out of a ``width``-dimensional vector (a Slice)."""
    cols = torch.as_tensor(columns, dtype=torch.long).reshape(-1)
    rows = torch.arange(cols.numel())
    return from_coo(torch.stack([rows, cols]), torch.ones(cols.numel(), dtype=DTYPE), (cols.numel(), width))


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Sparse @ sparse, exact fp64 sums, stored zeros dropped."""
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"cannot multiply {tuple(a.shape)} by {tuple(b.shape)}")
    if a._nnz() == 0 or b._nnz() == 0:
        return zeros(a.shape[0], b.shape[1])
    with warnings.catch_warnings():  # torch routes COO @ COO through its (beta) CSR kernels
        warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
        return prune(torch.sparse.mm(a, b))


def matvec(a: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Sparse ``[m, n]`` @ dense ``[n]`` -> dense ``[m]``."""
    if a._nnz() == 0:
        return torch.zeros(a.shape[0], dtype=v.dtype)
    return torch.sparse.mm(a.to(v.dtype), v.reshape(-1, 1)).reshape(-1)


def vstack(mats: Sequence[torch.Tensor]) -> torch.Tensor:
    """Stack matrices with equal column counts on top of each other."""
    cols = mats[0].shape[1]
    indices, values, offset = [], [], 0
    for m in mats:
        if m.shape[1] != cols:
            raise ValueError(f"vstack: {m.shape[1]} columns, expected {cols}")
        idx = m.indices().clone()
        idx[0] += offset
        indices.append(idx)
        values.append(m.values())
        offset += m.shape[0]
    return from_coo(torch.cat(indices, dim=1), torch.cat(values), (offset, cols))


def hstack(mats: Sequence[torch.Tensor]) -> torch.Tensor:
    """Place matrices with equal row counts side by side."""
    return vstack([m.t().coalesce() for m in mats]).t().coalesce()


def block_diag(mats: Sequence[torch.Tensor]) -> torch.Tensor:
    """Block-diagonal matrix of ``mats``."""
    indices, values, rows, cols = [], [], 0, 0
    for m in mats:
        idx = m.indices().clone()
        idx[0] += rows
        idx[1] += cols
        indices.append(idx)
        values.append(m.values())
        rows += m.shape[0]
        cols += m.shape[1]
    if not indices:
        return zeros(0, 0)
    return from_coo(torch.cat(indices, dim=1), torch.cat(values), (rows, cols))


def rows(matrix: torch.Tensor, index: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """The rows ``index`` of ``matrix`` (in that order)."""
    return matmul(selection(index, matrix.shape[0]), matrix)


def used_columns(matrix: torch.Tensor) -> torch.Tensor:
    """Sorted indices of the columns holding at least one non-zero."""
    return torch.unique(matrix.indices()[1])


def is_identity(matrix: torch.Tensor) -> bool:
    """Whether ``matrix`` is exactly the identity (square, ones on the diagonal and nothing else)."""
    n, m = matrix.shape
    if n != m or matrix._nnz() != n:
        return False
    idx = matrix.indices()
    return bool((idx[0] == idx[1]).all() and (matrix.values() == 1).all())
