"""PyTorch reference for one Mamba-1 mixer decode step, written with the other ops' references.

Per sequence ``b`` in slot ``slot_ids[b]``::

    x, z = in_proj(h)                            # [B, Di] each
    x = silu(causal_conv1d_update(x, conv tail))  # shifts x into the slot's conv tail
    dt, B, C = x_proj(x);  dt = dt_proj(dt)       # dt_proj without its bias: the scan adds dt_bias
    y = selective_state_update(x, dt, A, B, C, D, z, dt_bias, softplus)   # advances the slot's SSM state
    out = out_proj(y)

Weights are in ``h``'s dtype; ``conv_weight [Di, K]``, ``dt_bias [Di]``, ``A [Di, N]`` (already ``-exp(A_log)``)
and ``D [Di]`` in fp32, as the model keeps them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rnnserve.kernels.causal_conv1d.naive import causal_conv1d_update_ref
from rnnserve.kernels.selective_scan.naive import selective_state_update_ref


def mamba_mixer_decode_ref(
    h: torch.Tensor,
    in_proj_weight: torch.Tensor,
    in_proj_bias: torch.Tensor | None,
    conv_pool: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    slot_ids: torch.Tensor,
    x_proj_weight: torch.Tensor,
    dt_proj_weight: torch.Tensor,
    dt_bias: torch.Tensor,
    A: torch.Tensor,
    D: torch.Tensor,
    ssm_pool: torch.Tensor,
    out_proj_weight: torch.Tensor,
    out_proj_bias: torch.Tensor | None,
) -> torch.Tensor:
    """``h [B, d_model]`` -> ``out [B, d_model]``; updates ``conv_pool [N, Di, K-1]`` and ``ssm_pool [N, Di, Ns]``
    at rows ``slot_ids`` in place."""
    d_inner, d_state, dt_rank = conv_weight.shape[0], A.shape[1], dt_proj_weight.shape[1]
    x, z = F.linear(h, in_proj_weight, in_proj_bias).split(d_inner, dim=-1)
    x, conv_tail = causal_conv1d_update_ref(x, conv_pool[slot_ids], conv_weight, conv_bias)
    x = F.silu(x)
    dt, B, C = F.linear(x, x_proj_weight).split([dt_rank, d_state, d_state], dim=-1)
    dt = F.linear(dt, dt_proj_weight)
    y, ssm_state = selective_state_update_ref(ssm_pool[slot_ids], x, dt, A, B, C, D, z, dt_bias, True)
    conv_pool[slot_ids] = conv_tail.to(conv_pool.dtype)
    ssm_pool[slot_ids] = ssm_state
    return F.linear(y.to(h.dtype), out_proj_weight, out_proj_bias)
