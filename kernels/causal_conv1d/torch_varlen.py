"""Varlen causal conv1d prefill in PyTorch, organised for CPUs (the path when neither Triton nor the C++
kernel applies).

Every tap is a row shift of the packed batch (a view, no gather); only the first ``K-1`` tokens of each
sequence, whose windows reach into the state tail, are recomputed from gathered rows as in the reference.
Taps are summed in the decode update's order.
"""

from __future__ import annotations

import torch

from rnnserve.kernels.causal_conv1d.naive import window_index


def causal_conv1d_varlen_torch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    initial_state: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as :func:`~rnnserve.kernels.causal_conv1d.naive.causal_conv1d_varlen_ref`."""
    total, channels = x.shape
    width = weight.shape[1]
    history = width - 1
    batch = cu_seqlens.numel() - 1
    if initial_state is None:
        initial_state = x.new_zeros(batch, channels, history, dtype=torch.float32)
    ext = torch.cat([initial_state.transpose(1, 2).reshape(-1, channels).float(), x.float()])
    w = weight.float()
    offset = batch * history
    taps, tails = window_index(cu_seqlens, width, total)

    def convolve(rows: list[torch.Tensor] | None) -> torch.Tensor:
        """``rows=None``: shifted views over every token; else gathered rows for each tap."""
        current = ext[offset:] if rows is None else ext[rows[history]]
        y = current * w[:, history]
        if bias is not None:
            y = y + bias.float()
        for tap in range(history):
            shift = history - tap
            y.addcmul_(ext[offset - shift : offset - shift + total] if rows is None else ext[rows[tap]], w[:, tap])
        return y

    y = convolve(None)
    near_start = (taps[0] < offset).nonzero().squeeze(1)
    y[near_start] = convolve([taps[tap, near_start] for tap in range(width)])
    return y.to(x.dtype), ext[tails].transpose(1, 2)
