"""Rotary position embeddings (RoPE) in the half-split layout, on all or the first ``rotary_dim`` channels."""

from __future__ import annotations

import torch


def rope_cos_sin(
    positions: torch.Tensor, rotary_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin [N, 1, rotary_dim]`` in ``dtype`` for ``positions [N]`` (angles computed in fp32).

    Channel ``i`` and ``i + rotary_dim / 2`` rotate together at frequency ``theta^(-2i / rotary_dim)``; the
    result broadcasts over the heads of ``[N, heads, head_dim]`` queries and keys.
    """
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=positions.device) / rotary_dim
    freqs = positions.float()[:, None] * (1.0 / theta**exponents)
    angles = torch.cat([freqs, freqs], dim=-1)[:, None, :]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``cos.shape[-1]`` channels of ``x [N, heads, head_dim]``; the rest pass through."""
    rotary_dim = cos.shape[-1]
    half = rotary_dim // 2
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    return torch.cat([rot * cos + rotated * sin, rest], dim=-1)
