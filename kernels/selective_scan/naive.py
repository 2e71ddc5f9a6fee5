"""PyTorch reference for Mamba-1's selective scan over packed variable-length batches.

Per channel ``d`` and state index ``n``::

    h_t[d, n] = exp(dt_t[d] * A[d, n]) * h_{t-1}[d, n] + dt_t[d] * B_t[n] * x_t[d]
    y_t[d]    = sum_n C_t[n] * h_t[d, n] + D[d] * x_t[d],   then  y_t *= silu(z_t)   (if z is given)

``dt`` is discretised by :func:`discretise` (optional bias, optional softplus) first. Layouts:
``x, dt, z [T, Di]``, ``B, C [T, N]``, ``A [Di, N]``, ``D [Di]``, states ``[B, Di, N]`` in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def discretise(dt: torch.Tensor, dt_bias: torch.Tensor | None, softplus: bool) -> torch.Tensor:
    """``softplus(dt + dt_bias)`` in fp32 (each part optional)."""
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    return F.softplus(dt) if softplus else dt


def gate_output(
    y: torch.Tensor, x: torch.Tensor, D: torch.Tensor | None, z: torch.Tensor | None
) -> torch.Tensor:
    """Add the skip term ``D * x`` and apply the SiLU gate ``z``."""
    if D is not None:
        y = y + x.float() * D.float()
    if z is not None:
        y = y * F.silu(z.float())
    return y


def selective_scan_ref(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    cu_seqlens: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token ground truth; returns ``(y [T, Di] fp32, final_state [B, Di, N] fp32)``."""
    dt = discretise(dt, dt_bias, dt_softplus)
    batch = cu_seqlens.numel() - 1
    d_inner, d_state = A.shape
    h_all = (
        x.new_zeros(batch, d_inner, d_state, dtype=torch.float32)
        if initial_state is None
        else initial_state.float()
    )
    y = x.new_zeros(x.shape[0], d_inner, dtype=torch.float32)
    finals = []
    A = A.float()
    for b in range(batch):
        h = h_all[b]
        for t in range(int(cu_seqlens[b]), int(cu_seqlens[b + 1])):
            delta = dt[t].float()[:, None]
            h = torch.exp(delta * A) * h + delta * B[t].float()[None, :] * x[t].float()[:, None]
            y[t] = h @ C[t].float()
        finals.append(h)
    final = torch.stack(finals) if finals else h_all
    return gate_output(y, x, D, z), final


def selective_state_update_ref(
    h: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step for ``h [B, Di, N]``; returns ``(y [B, Di] fp32, new_h [B, Di, N] fp32)``."""
    delta = discretise(dt, dt_bias, dt_softplus)[:, :, None]
    h = torch.exp(delta * A.float()) * h.float() + delta * B.float()[:, None, :] * x.float()[:, :, None]
    y = (h @ C.float()[:, :, None])[:, :, 0]
    return gate_output(y, x, D, z), h
