"""Causal depthwise conv1d with a per-slot state tail (prefill over packed batches, one-step update).

``naive.py`` is the PyTorch reference, ``chunked.py`` the Triton varlen prefill, ``fused_recurrent.py`` the
Triton decode update that shifts the tail of each slot in place, ``causal_conv1d_cpu.cpp`` a fused C++ decode update for
CPU tensors (see :mod:`rnnserve.kernels.cpu_extension`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rnnserve.kernels.backend import use_triton
from rnnserve.kernels.causal_conv1d.naive import _window_index, causal_conv1d_update_ref, causal_conv1d_varlen_ref
from rnnserve.kernels.cpu_extension import use_cpu_kernel


def causal_conv1d_varlen(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    silu: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed ``x [T, C]``, ``weight [C, K]`` -> ``(y [T, C], final_state [B, C, K-1])``, ``y`` SiLU'd when
    ``silu``.

    Each sequence continues from its ``initial_state [B, C, K-1]`` tail (zeros when ``None``).
    """
    if use_triton(x):
        from rnnserve.kernels.causal_conv1d.chunked import causal_conv1d_varlen_triton

        y, final = causal_conv1d_varlen_triton(x, weight, bias, cu_seqlens, initial_state)
        return (F.silu(y) if silu else y), final
    if _fused_cpu(x, weight) and (initial_state is None or initial_state.stride(-1) == 1):
        return torch.ops.rnnserve.causal_conv1d_varlen(
            x,
            weight.float().contiguous(),
            None if bias is None else bias.float().contiguous(),
            cu_seqlens.long().contiguous(),
            None if initial_state is None else initial_state.float(),
            silu,
        )
    y, final = _causal_conv1d_varlen_shifted(x, weight, bias, cu_seqlens, initial_state)
    return (F.silu(y) if silu else y), final


def _fused_cpu(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True when the fused C++ kernels take this conv (CPU, fp32/bf16 activations, widths 2-4)."""
    return use_cpu_kernel(x) and x.dtype in (torch.float32, torch.bfloat16) and 2 <= weight.shape[1] <= 4


def _causal_conv1d_varlen_shifted(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    initial_state: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch path of :func:`causal_conv1d_varlen`: every tap is a row shift of the packed batch (a view,
    no gather); only the first ``K-1`` tokens of each sequence, whose windows reach into the state tail, are
    recomputed from gathered rows as in the reference. Taps are summed in the decode update's order."""
    total, channels = x.shape
    width = weight.shape[1]
    history = width - 1
    batch = cu_seqlens.numel() - 1
    if initial_state is None:
        initial_state = x.new_zeros(batch, channels, history, dtype=torch.float32)
    ext = torch.cat([initial_state.transpose(1, 2).reshape(-1, channels).float(), x.float()])
    w = weight.float()
    offset = batch * history
    taps, tails = _window_index(cu_seqlens, width, total)

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


def causal_conv1d_update(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    slot_ids: torch.Tensor,
    silu: bool = False,
) -> torch.Tensor:
    """One decode step for ``x [B, C]``: returns ``y [B, C]`` (SiLU'd when ``silu``) and shifts ``x`` into
    ``conv_state[slot_ids]``.

    ``conv_state`` is a pool ``[N, C, K-1]`` (a strided view such as ``pool[:, layer]`` is fine), updated in
    place.
    """
    if use_triton(x):
        from rnnserve.kernels.causal_conv1d.fused_recurrent import causal_conv1d_update_triton

        y = causal_conv1d_update_triton(x, conv_state, weight, bias, slot_ids)
        return F.silu(y) if silu else y
    if _fused_cpu(x, weight) and conv_state.dtype == torch.float32 and conv_state.stride(-1) == 1:
        return torch.ops.rnnserve.causal_conv1d_update(
            x,
            conv_state,
            weight.float().contiguous(),
            None if bias is None else bias.float().contiguous(),
            slot_ids.long().contiguous(),
            silu,
        )
    y = _causal_conv1d_update_pool(x, conv_state, weight, bias, slot_ids)
    return F.silu(y) if silu else y


def _causal_conv1d_update_pool(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    slot_ids: torch.Tensor,
) -> torch.Tensor:
    """PyTorch path of :func:`causal_conv1d_update`: the reference's math with one multiply-add per tap
    (no reduction over the short tap axis) and one ``index_copy_`` back into the pool, about 2x faster on CPU
    than gathering a window and scattering through advanced indexing."""
    tail = conv_state[slot_ids].float()
    w = weight.float()
    width = w.shape[1]
    x32 = x.float()
    y = x32 * w[:, width - 1]
    if bias is not None:
        y = y + bias.float()
    for tap in range(width - 1):
        y.addcmul_(tail[:, :, tap], w[:, tap])
    shifted = torch.cat([tail[:, :, 1:], x32[:, :, None]], dim=2)
    conv_state.index_copy_(0, slot_ids, shifted.to(conv_state.dtype))
    return y.to(x.dtype)


__all__ = [
    "causal_conv1d_varlen",
    "causal_conv1d_update",
    "causal_conv1d_varlen_ref",
    "causal_conv1d_update_ref",
]
