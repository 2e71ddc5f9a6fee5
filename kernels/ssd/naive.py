"""PyTorch reference for Mamba-2's SSD recurrence (scalar decay per head, B/C shared within head groups).

Per head ``h`` (group ``g = h // (H / G)``), channel ``p`` and state index ``n``::

    S_t[h, p, n] = exp(dt_t[h] * A[h]) * S_{t-1}[h, p, n] + dt_t[h] * x_t[h, p] * B_t[g, n]
    y_t[h, p]    = sum_n C_t[g, n] * S_t[h, p, n] + D[h] * x_t[h, p]

``dt`` is already discretised. Layouts: ``x [T, H, P]``, ``dt [T, H]``, ``A, D [H]``, ``B, C [T, G, N]``,
states ``[B, H, P, N]`` in fp32.
"""

from __future__ import annotations

import torch


def expand_groups(t: torch.Tensor, num_heads: int) -> torch.Tensor:
    """``[..., G, N]`` -> ``[..., H, N]`` (each group serves ``H / G`` consecutive heads)."""
    return t.repeat_interleave(num_heads // t.shape[-2], dim=-2)


def discretize_dt(
    dt: torch.Tensor,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
) -> torch.Tensor:
    """The Mamba-2 block's step sizes in fp32: ``clamp(softplus(dt + dt_bias), *dt_limit)``, each part optional
    (the clamp only when ``dt_limit`` is not ``(0, inf)``)."""
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    if dt_softplus:
        dt = torch.nn.functional.softplus(dt)
    if dt_limit != (0.0, float("inf")):
        dt = dt.clamp(*dt_limit)
    return dt


def ssd_scan_ref(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    cu_seqlens: torch.Tensor,
    D: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token ground truth; returns ``(y [T, H, P] fp32, final_state [B, H, P, N] fp32)``."""
    batch = cu_seqlens.numel() - 1
    _, heads, head_dim = x.shape
    d_state = B.shape[-1]
    states = (
        x.new_zeros(batch, heads, head_dim, d_state, dtype=torch.float32)
        if initial_state is None
        else initial_state.float()
    )
    Bh, Ch = expand_groups(B.float(), heads), expand_groups(C.float(), heads)
    y = x.new_zeros(x.shape, dtype=torch.float32)
    finals = []
    for b in range(batch):
        s = states[b]
        for t in range(int(cu_seqlens[b]), int(cu_seqlens[b + 1])):
            delta = dt[t].float()
            s = (
                torch.exp(delta * A.float())[:, None, None] * s
                + (delta[:, None] * x[t].float())[:, :, None] * Bh[t][:, None]
            )
            y[t] = (s @ Ch[t][:, :, None])[..., 0]
        finals.append(s)
    if D is not None:
        y = y + D.float()[:, None] * x.float()
    return y, torch.stack(finals) if finals else states
