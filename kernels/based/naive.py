"""References for Based's Taylor linear attention (the test oracles).

Feature map (second-order Taylor expansion of ``exp``), for ``x [..., f]`` and ``scale = input_dim^-1/2``::

    phi(x) = [1, x * sqrt(scale), vec(x x^T) * scale / sqrt(2)]        # 1 + f + f^2 features

so ``phi(q) . phi(k) = 1 + s + s^2 / 2`` with ``s = scale * q . k``. A sequence's output at ``i`` is
``sum_{j<=i} a_ij v_j / (sum_{j<=i} a_ij + eps)`` with ``a_ij = phi(q_i) . phi(k_j)``. The recurrent state of a
head is ``S = sum_j phi(k_j) v_j^T [1 + f + f^2, d_v]`` and ``z = sum_j phi(k_j) [1 + f + f^2]``, both fp32.
"""

from __future__ import annotations

import math

import torch


def taylor_features(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``phi(x)`` in fp32: ``x [..., f] -> [..., 1 + f + f^2]``."""
    x = x.float()
    quadratic = (x[..., :, None] * x[..., None, :]).flatten(-2) * (scale / math.sqrt(2.0))
    return torch.cat([torch.ones_like(x[..., :1]), x * math.sqrt(scale), quadratic], dim=-1)


def based_quadratic_naive(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, eps: float) -> torch.Tensor:
    """One sequence from zero state, as a quadratic form: ``q, k [L, H, f]``, ``v [L, H, d]`` -> fp32 ``[L, H, d]``."""
    s = torch.einsum("ihf,jhf->hij", q.float(), k.float()) * scale
    a = torch.tril(1.0 + s + 0.5 * s * s)
    out = torch.einsum("hij,jhd->ihd", a, v.float())
    return out / (a.sum(-1).transpose(0, 1)[..., None] + eps)


def based_recurrent_naive(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    initial_state: tuple[torch.Tensor, torch.Tensor] | None,
    scale: float,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed ``q, k [T, H, f]``, ``v [T, H, d]``, token by token with explicit features.

    ``initial_state`` is ``(S [B, H, D, d], z [B, H, D])`` (zeros when ``None``), ``D = 1 + f + f^2``.
    Returns ``(o [T, H, d] fp32, S_final, z_final)``; the state is updated before each token's read-out.
    """
    batch, heads, f, d = cu_seqlens.numel() - 1, q.shape[1], q.shape[2], v.shape[2]
    features = 1 + f + f * f
    if initial_state is None:
        s_state = q.new_zeros(batch, heads, features, d, dtype=torch.float32)
        z_state = q.new_zeros(batch, heads, features, dtype=torch.float32)
    else:
        s_state, z_state = (t.float().clone() for t in initial_state)
    out = torch.empty(q.shape[0], heads, d, dtype=torch.float32, device=q.device)
    phi_q, phi_k = taylor_features(q, scale), taylor_features(k, scale)
    bounds = cu_seqlens.tolist()
    for b in range(batch):
        for t in range(bounds[b], bounds[b + 1]):
            s_state[b] += phi_k[t, :, :, None] * v[t, :, None, :].float()
            z_state[b] += phi_k[t]
            numerator = torch.einsum("hD,hDd->hd", phi_q[t], s_state[b])
            out[t] = numerator / ((phi_q[t] * z_state[b]).sum(-1, keepdim=True) + eps)
    return out, s_state, z_state


def based_step_naive(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    s_pool: torch.Tensor,
    z_pool: torch.Tensor,
    slot_ids: torch.Tensor,
    scale: float,
    eps: float,
) -> torch.Tensor:
    """One decode step: ``q, k [B, H, f]``, ``v [B, H, d]``; pools ``S [N, H, D, d]``, ``z [N, H, D]`` updated in
    place at rows ``slot_ids``. Returns fp32 ``[B, H, d]``."""
    phi_q, phi_k = taylor_features(q, scale), taylor_features(k, scale)
    s_rows = s_pool[slot_ids] + phi_k[..., None] * v.float()[:, :, None, :]
    z_rows = z_pool[slot_ids] + phi_k
    s_pool[slot_ids] = s_rows
    z_pool[slot_ids] = z_rows
    numerator = torch.einsum("bhD,bhDd->bhd", phi_q, s_rows)
    return numerator / ((phi_q * z_rows).sum(-1, keepdim=True) + eps)
