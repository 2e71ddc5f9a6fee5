"""Reference for :func:`rnnserve.kernels.mamba2_decode.mamba2_mixer_step`, composed from PyTorch ops and the
SSD state update's reference."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rnnserve.kernels.residual_rms_norm.naive import rms_normalize
from rnnserve.kernels.ssd.torch_recurrent import ssd_state_update_torch


def mamba2_mixer_step_ref(
    xbc: torch.Tensor,
    dt_raw: torch.Tensor,
    z: torch.Tensor,
    pool: torch.Tensor,
    slot_ids: torch.Tensor,
    dt_bias: torch.Tensor,
    A_log: torch.Tensor,
    D: torch.Tensor,
    norm_weight: torch.Tensor,
    groups: int,
    eps: float,
    dt_min: float,
    dt_max: float,
) -> torch.Tensor:
    """SiLU on ``xBC``, discretised ``dt``, the SSD state update of ``pool[slot_ids]`` (in place) and the gated
    per-group RMSNorm; returns ``[B, d_inner]`` in ``z``'s dtype."""
    heads, head_dim, d_state = pool.shape[1:]
    x, B, C = F.silu(xbc).split([z.shape[-1], groups * d_state, groups * d_state], dim=-1)
    dt = F.softplus(dt_raw.float() + dt_bias.float()).clamp(dt_min, dt_max)
    A = -torch.exp(A_log.float())
    y = ssd_state_update_torch(
        pool,
        slot_ids,
        x.unflatten(-1, (heads, head_dim)),
        dt,
        A,
        B.unflatten(-1, (groups, d_state)),
        C.unflatten(-1, (groups, d_state)),
        D,
    )
    gated = (y.flatten(1) * F.silu(z.float())).unflatten(-1, (groups, -1))
    return norm_weight * rms_normalize(gated, eps).flatten(-2).to(z.dtype)
