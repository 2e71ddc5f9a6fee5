"""PyTorch decode step of Taylor linear attention, updating the pool rows in place (the CPU path): the state
is read once and written once by the update, read once more by the read-out."""

from __future__ import annotations

import torch

from rnnserve.kernels.based.naive import taylor_features


def based_step_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    s_pool: torch.Tensor,
    z_pool: torch.Tensor,
    slots: torch.Tensor | slice,
    scale: float,
    eps: float,
) -> torch.Tensor:
    """Same contract as :func:`rnnserve.kernels.based.naive.based_step_naive`; ``slots`` may be a slice
    (consecutive slots: the pool rows are views and are updated without a gather or scatter)."""
    phi_q, phi_k = taylor_features(q, scale), taylor_features(k, scale)
    # Consecutive slots: views of the pool, updated where they lie; else a gather and a scatter.
    s_rows, z_rows = s_pool[slots], z_pool[slots]
    s_rows.addcmul_(phi_k[..., None], v.float()[:, :, None, :])  # rank-1 update in place, no temporary
    z_rows.add_(phi_k)
    if not isinstance(slots, slice):
        s_pool[slots] = s_rows
        z_pool[slots] = z_rows
    numerator = torch.matmul(phi_q[:, :, None, :], s_rows)[:, :, 0]
    return numerator / ((phi_q * z_rows).sum(-1, keepdim=True) + eps)
