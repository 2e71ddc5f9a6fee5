"""PyTorch reference for Lattice's orthogonal state recurrence (Karami & Mirrokni, "Lattice", Eq. 13, 14, 16).

Per head the state ``S [d, m]`` holds ``m`` memory slots (columns ``s_i``). One token with query and key
``q, k [m]``, value ``v [d]``, step size ``gamma`` and forget gate ``mu`` (1 without one) does::

    phi_i = s_i / |s_i|
    DEC: e = phi(S) k - v   h = e    c = k        (loss |phi(S) k - v|^2, Eq. 6/7)
    ENC: e = phi(S)^T v - k h = v    c = e        (loss |phi(S)^T v - k|^2, Eq. 9/10)
    SIM:                    h = -v   c = k        (loss -<phi(S)^T v, k>, Eq. 11/12)
    s_i <- mu s_i - gamma c_i P(s_i) h / |s_i|,   P(s) = I - s s^T / |s|^2   (Eq. 13, Eq. 16)
    s_i <- s_i / |s_i|                            (Eq. 14, when ``normalize``: back onto the unit sphere)
    y = S q                                       (read-out from the updated state)

The step size absorbs the factor 2 of the squared losses. With ``normalize`` the column is divided by its
actual norm (not by Eq. 14's ``(1 + |ds|^2)^(-1/2)``, which assumes the old column had norm 1 exactly), so
rounding errors never accumulate; the update is first rescaled per column (a positive factor, which the
normalisation cancels) so that neither huge inputs nor a closed forget gate produce inf or NaN. A column
whose update vanishes with ``mu = 0`` keeps its old value.

Everything runs in fp32. ``variant`` is ``"dec"``, ``"enc"`` or ``"sim"``.
"""

from __future__ import annotations

import torch

VARIANTS = ("dec", "enc", "sim")
TINY = 1e-30


def lattice_step_ref(
    state: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gamma: torch.Tensor,
    mu: torch.Tensor | None,
    variant: str,
    normalize: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for any leading batch shape ``[...]``: ``state [..., d, m]``, ``q, k [..., m]``, ``v [..., d]``,
    ``gamma, mu [...]`` -> ``(new_state [..., d, m], y [..., d])``, both fp32."""
    s = state.float()
    q, k, v, gamma = q.float(), k.float(), v.float(), gamma.float()
    mu = torch.ones_like(gamma) if mu is None else mu.float()
    norms = torch.linalg.vector_norm(s, dim=-2).clamp_min(TINY)  # [..., m]
    phi = s / norms[..., None, :]
    if variant == "dec":
        e = torch.einsum("...dm,...m->...d", phi, k) - v
        h, c = e, k
    elif variant == "enc":
        e = torch.einsum("...dm,...d->...m", phi, v) - k
        h, c = v, e
    elif variant == "sim":
        h, c = -v, k
    else:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    a = -gamma[..., None] * c / norms  # [..., m]: the scalar in front of P(s_i) h
    if not normalize:
        r = torch.einsum("...dm,...d->...m", phi, h)
        w = h[..., :, None] - phi * r[..., None, :]
        new = mu[..., None, None] * s + w * a[..., None, :]
    else:
        scale = h.abs().amax(-1).clamp_min(TINY)  # [...]: h / scale has entries in [-1, 1]
        h_hat = h / scale[..., None]
        r_hat = torch.einsum("...dm,...d->...m", phi, h_hat)
        w_hat = h_hat[..., :, None] - phi * r_hat[..., None, :]
        b = a * scale[..., None]  # column i of the update is b_i * w_hat_i
        mu_m = mu[..., None].expand_as(b)
        denom = torch.maximum(mu_m, b.abs())
        coef_s = torch.where(denom > 0, mu_m / denom, torch.ones_like(b))
        coef_w = torch.where(b.abs() >= mu_m, torch.sign(b), b / denom)
        u = s * coef_s[..., None, :] + w_hat * coef_w[..., None, :]
        u_norm = torch.linalg.vector_norm(u, dim=-2)
        new = torch.where(u_norm[..., None, :] > 0, u / u_norm.clamp_min(TINY)[..., None, :], s)
    y = torch.einsum("...dm,...m->...d", new, q)
    return new, y


def lattice_varlen_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gamma: torch.Tensor,
    mu: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    state: torch.Tensor,
    slot_ids: torch.Tensor,
    variant: str,
    normalize: bool = True,
) -> torch.Tensor:
    """Packed ``q, k [T, H, m]``, ``v [T, H, d]``, ``gamma, mu [T, H]`` -> ``y [T, H, d]`` fp32, step by step.

    ``state [N, H, d, m]`` is a pool (a strided view such as ``pool[:, layer]`` is fine): rows ``slot_ids``
    hold each sequence's initial state and receive its final state. The sequences are padded to the longest
    and advance together, one token per step; a finished sequence's state stops changing.
    """
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    batch, total = lengths.numel(), q.shape[0]
    max_len = int(lengths.max()) if batch else 0
    seq = torch.repeat_interleave(torch.arange(batch, device=q.device), lengths, output_size=total)
    pos = torch.arange(total, device=q.device) - cu_seqlens[:-1][seq]

    def pad(x: torch.Tensor) -> torch.Tensor:
        out = x.new_zeros(batch, max_len, *x.shape[1:], dtype=torch.float32)
        out[seq, pos] = x.float()
        return out

    qp, kp, vp, gp = pad(q), pad(k), pad(v), pad(gamma)
    mp = None if mu is None else pad(mu)
    s = state[slot_ids].float()
    ys = []
    for t in range(max_len):
        gate = None if mp is None else mp[:, t]
        new, y = lattice_step_ref(s, qp[:, t], kp[:, t], vp[:, t], gp[:, t], gate, variant, normalize)
        s = torch.where((t < lengths)[:, None, None, None], new, s)
        ys.append(y)
    state[slot_ids] = s
    if not ys:
        return v.new_zeros(v.shape, dtype=torch.float32)
    return torch.stack(ys, 1)[seq, pos]


def lattice_decode_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gamma: torch.Tensor,
    mu: torch.Tensor | None,
    state: torch.Tensor,
    slot_ids: torch.Tensor,
    variant: str,
    normalize: bool = True,
) -> torch.Tensor:
    """One token per sequence: ``q, k [B, H, m]``, ``v [B, H, d]``, ``gamma, mu [B, H]`` -> ``y [B, H, d]``;
    rows ``slot_ids`` of the pool ``state [N, H, d, m]`` are updated in place."""
    new, y = lattice_step_ref(state[slot_ids], q, k, v, gamma, mu, variant, normalize)
    state[slot_ids] = new
    return y
