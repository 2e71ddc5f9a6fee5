"""PyTorch reference for the causal depthwise conv1d with a state tail.

Layout: packed inputs ``x [T, C]``; weight ``[C, K]`` (tap ``K-1`` multiplies the current token);
state tail ``[B, C, K-1]`` holding each sequence's last ``K-1`` inputs, oldest first. Computes in fp32;
outputs have ``x``'s dtype, states are fp32.
"""

from __future__ import annotations

import torch


def window_index(cu_seqlens: torch.Tensor, width: int, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row indices into ``ext = [tails (B*(K-1) rows); x (T rows)]`` for every conv tap and final tail.

    Returns ``taps [K, T]`` and ``tails [B, K-1]``.
    """
    device = cu_seqlens.device
    history = width - 1
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    batch = lengths.numel()
    seq = torch.repeat_interleave(torch.arange(batch, device=device), lengths, output_size=total)
    pos = torch.arange(total, device=device) - cu_seqlens[:-1][seq]

    def rows(seq_idx: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        from_tail = seq_idx * history + q + history
        from_x = batch * history + cu_seqlens[:-1][seq_idx] + q
        return torch.where(q < 0, from_tail, from_x)

    taps = torch.stack([rows(seq, pos - history + j) for j in range(width)])
    tail_q = lengths[:, None] - history + torch.arange(history, device=device)[None, :]
    tails = rows(torch.arange(batch, device=device)[:, None].expand(-1, history), tail_q)
    return taps, tails


def causal_conv1d_varlen_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise conv over a packed batch; returns ``(y [T, C], final_state [B, C, K-1])``.

    Each sequence continues from its ``initial_state`` tail (zeros when ``None``).
    """
    total, channels = x.shape
    width = weight.shape[1]
    batch = cu_seqlens.numel() - 1
    if initial_state is None:
        initial_state = x.new_zeros(batch, channels, width - 1, dtype=torch.float32)
    ext = torch.cat([initial_state.transpose(1, 2).reshape(-1, channels).float(), x.float()])
    taps, tails = window_index(cu_seqlens, width, total)
    w = weight.float()
    y = ext[taps[0]] * w[:, 0]
    for j in range(1, width):
        y = y + ext[taps[j]] * w[:, j]
    if bias is not None:
        y = y + bias.float()
    final_state = ext[tails].transpose(1, 2)
    return y.to(x.dtype), final_state


def causal_conv1d_update_ref(
    x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step: ``x [B, C]``, ``conv_state [B, C, K-1]`` -> ``(y [B, C], new_state)``."""
    window = torch.cat([conv_state.float(), x.float()[:, :, None]], dim=2)
    y = (window * weight.float()).sum(-1)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype), window[:, :, 1:]
