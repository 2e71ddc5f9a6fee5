"""Causal depthwise conv1d with a per-slot state tail (prefill over packed batches, one-step update).

``naive.py`` is the PyTorch reference; ``chunk.py`` the Triton varlen prefill and ``fused_recurrent.py`` the
Triton decode update that shifts each slot's tail in place; ``causal_conv1d_cpu.cpp`` fused C++ kernels for
both (see :mod:`rnnserve.kernels.cpu_extension`); ``torch_varlen.py`` and ``torch_recurrent.py`` PyTorch paths
organised for CPUs, used when neither kernel applies.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rnnserve.kernels.backend import on_pool_rows, use_triton
from rnnserve.kernels.causal_conv1d.torch_recurrent import causal_conv1d_update_torch
from rnnserve.kernels.causal_conv1d.torch_varlen import causal_conv1d_varlen_torch
from rnnserve.kernels.cpu_extension import use_cpu_kernel


def causal_conv1d_varlen(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    silu: bool = False,
    slot_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed ``x [T, C]``, ``weight [C, K]`` -> ``(y [T, C], final_state [B, C, K-1])``, ``y`` SiLU'd when
    ``silu``.

    Each sequence continues from its ``initial_state [B, C, K-1]`` tail (zeros when ``None``). With ``slot_ids``
    ``initial_state`` is an fp32 state pool ``[num_slots, C, K-1]`` whose rows ``slot_ids`` are read and
    overwritten in place (the Triton kernel addresses them directly); the pool is returned as the final state.
    """
    if use_triton(x) and weight.shape[1] >= 2:  # width 1 (no state) runs the PyTorch path
        from rnnserve.kernels.causal_conv1d.chunk import causal_conv1d_varlen_triton

        return causal_conv1d_varlen_triton(x, weight, bias, cu_seqlens, initial_state, silu, slot_ids)
    if slot_ids is not None:
        return on_pool_rows(lambda h0: causal_conv1d_varlen(x, weight, bias, cu_seqlens, h0, silu), initial_state,
                            slot_ids)
    if _fused_cpu(x, weight) and (initial_state is None or initial_state.stride(-1) == 1):
        return torch.ops.rnnserve.causal_conv1d_varlen(
            x,
            weight.float().contiguous(),
            None if bias is None else bias.float().contiguous(),
            cu_seqlens.long().contiguous(),
            None if initial_state is None else initial_state.float(),
            silu,
        )
    y, final = causal_conv1d_varlen_torch(x, weight, bias, cu_seqlens, initial_state)
    return (F.silu(y) if silu else y), final


def _fused_cpu(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True when the fused C++ kernels take this conv (CPU, fp32/bf16 activations, widths 2-4)."""
    return use_cpu_kernel(x) and x.dtype in (torch.float32, torch.bfloat16) and 2 <= weight.shape[1] <= 4


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
    if use_triton(x) and weight.shape[1] >= 2:
        from rnnserve.kernels.causal_conv1d.fused_recurrent import causal_conv1d_update_triton

        return causal_conv1d_update_triton(x, conv_state, weight, bias, slot_ids, silu)
    if _fused_cpu(x, weight) and conv_state.dtype == torch.float32 and conv_state.stride(-1) == 1:
        return torch.ops.rnnserve.causal_conv1d_update(
            x,
            conv_state,
            weight.float().contiguous(),
            None if bias is None else bias.float().contiguous(),
            slot_ids.long().contiguous(),
            silu,
        )
    y = causal_conv1d_update_torch(x, conv_state, weight, bias, slot_ids)
    return F.silu(y) if silu else y


__all__ = ["causal_conv1d_varlen", "causal_conv1d_update"]
