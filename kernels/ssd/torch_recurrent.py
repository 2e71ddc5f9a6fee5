"""Mamba-2 decode step applied in place to a state pool (``ssd_state_update_torch``), in PyTorch ops."""

from __future__ import annotations

import torch

from rnnserve.kernels.ssd.naive import expand_groups


def ssd_state_update_torch(
    state: torch.Tensor,
    slots: torch.Tensor | slice,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
) -> torch.Tensor:
    """Advance ``state[slots]`` (pool ``[N, H, P, Ns]`` fp32; a strided view is fine) by one token.

    ``slots``: ``[B]`` slot ids, or a ``slice`` for consecutive slots (updated in place, no gather/scatter).
    ``x [B, H, P]``, ``dt [B, H]`` (discretised), ``B, C [B, G, Ns]``; returns ``y [B, H, P]`` fp32.
    """
    heads = x.shape[1]
    delta = dt.float()
    decay = torch.exp(delta * A.float())[:, :, None, None]
    h = state[slots]
    h.mul_(decay).add_(
        (delta[:, :, None] * x.float())[..., None] * expand_groups(B.float(), heads)[:, :, None, :]
    )
    if not isinstance(slots, slice):
        state[slots] = h
    y = (h @ expand_groups(C.float(), heads)[..., None])[..., 0]
    if D is not None:
        y = y + D.float()[:, None] * x.float()
    return y
