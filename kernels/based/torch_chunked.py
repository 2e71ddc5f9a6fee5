"""Chunked PyTorch prefill of Taylor linear attention (the CPU path): per chunk of ``C`` tokens, the quadratic form
inside the chunk plus the read-out of the state carried from earlier chunks, then one state update.

Per head and chunk this is ``O(C^2 (f + d) + C D d)`` work with ``D = 1 + f + f^2``, against ``O(C D d)`` for
the token loop's updates alone, and the state is read and written once per chunk instead of once per token.
"""

from __future__ import annotations

import torch

from rnnserve.kernels.based.naive import taylor_features


def based_chunked_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    initial_state: tuple[torch.Tensor, torch.Tensor] | None,
    scale: float,
    eps: float,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract as :func:`rnnserve.kernels.based.naive.based_recurrent_naive`."""
    batch, heads, f, d = cu_seqlens.numel() - 1, q.shape[1], q.shape[2], v.shape[2]
    features = 1 + f + f * f
    if initial_state is None:
        s_state = q.new_zeros(batch, heads, features, d, dtype=torch.float32)
        z_state = q.new_zeros(batch, heads, features, dtype=torch.float32)
    else:
        s_state, z_state = (t.float().clone() for t in initial_state)
    q, k, v = q.float(), k.float(), v.float()
    out = torch.empty(q.shape[0], heads, d, dtype=torch.float32, device=q.device)
    bounds = cu_seqlens.tolist()
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    for b in range(batch):
        s_b, z_b = s_state[b], z_state[b]
        for lo in range(bounds[b], bounds[b + 1], chunk_size):
            hi = min(lo + chunk_size, bounds[b + 1])
            qc, kc, vc = q[lo:hi].transpose(0, 1), k[lo:hi].transpose(0, 1), v[lo:hi].transpose(0, 1)
            phi_q, phi_k = taylor_features(qc, scale), taylor_features(kc, scale)  # [H, C, D]
            s = torch.bmm(qc, kc.transpose(1, 2)) * scale
            a = (1.0 + s + 0.5 * s * s).masked_fill_(~causal[: hi - lo, : hi - lo], 0.0)
            numerator = torch.baddbmm(torch.bmm(a, vc), phi_q, s_b)
            denominator = a.sum(-1) + torch.bmm(phi_q, z_b[:, :, None])[..., 0]
            out[lo:hi] = (numerator / (denominator[..., None] + eps)).transpose(0, 1)
            s_b.baddbmm_(phi_k.transpose(1, 2), vc)
            z_b += phi_k.sum(1)
    return out, s_state, z_state
