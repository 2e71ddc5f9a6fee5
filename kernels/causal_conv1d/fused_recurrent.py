"""Triton one-step conv update: reads a slot's tail, emits the output, shifts the new input in (in place)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _conv_update_kernel(
    x_ptr, w_ptr, bias_ptr, state_ptr, slot_ids_ptr, y_ptr, channels, stride_x, stride_slot, stride_c,
    K: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
):
    i_b = tl.program_id(0)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    mask_c = cols < channels
    k = tl.arange(0, BK)
    slot = tl.load(slot_ids_ptr + i_b).to(tl.int64)
    tail_ptrs = state_ptr + slot * stride_slot + cols[:, None] * stride_c + k[None, :]
    x = tl.load(x_ptr + i_b * stride_x + cols, mask=mask_c, other=0.0).to(tl.float32)
    # window = [tail, x] over taps 0..K-1; shifted = [tail[1:], x], the new tail.
    window = tl.load(tail_ptrs, mask=mask_c[:, None] & (k < K - 1)[None, :], other=0.0).to(tl.float32)
    window += tl.where((k == K - 1)[None, :], x[:, None], 0.0)
    shifted = tl.load(tail_ptrs + 1, mask=mask_c[:, None] & (k < K - 2)[None, :], other=0.0).to(tl.float32)
    shifted += tl.where((k == K - 2)[None, :], x[:, None], 0.0)
    w = tl.load(w_ptr + cols[:, None] * K + k[None, :], mask=mask_c[:, None] & (k < K)[None, :], other=0.0)
    y = tl.sum(window * w.to(tl.float32), axis=1)
    if HAS_BIAS:
        y += tl.load(bias_ptr + cols, mask=mask_c, other=0.0).to(tl.float32)
    if SILU:
        y *= tl.sigmoid(y)
    tl.store(y_ptr + i_b * channels + cols, y, mask=mask_c)
    # Every thread has read the tail before any thread overwrites it.
    tl.debug_barrier()
    tl.store(tail_ptrs, shifted, mask=mask_c[:, None] & (k < K - 1)[None, :])


def causal_conv1d_update_triton(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    slot_ids: torch.Tensor,
    silu: bool = False,
) -> torch.Tensor:
    """``x [B, C]`` (any row stride, e.g. a column slice of a projection's output); ``conv_state [N, C, K-1]``
    updated in place at rows ``slot_ids`` -> ``y [B, C]`` contiguous, SiLU'd in fp32 when ``silu``."""
    batch, channels = x.shape
    width = weight.shape[1]
    if width < 2:
        raise ValueError("causal_conv1d needs a kernel width >= 2")
    if conv_state.stride(-1) != 1:
        raise ValueError("conv_state's last dimension must be contiguous")
    if x.stride(1) != 1:
        x = x.contiguous()
    weight = weight.contiguous()
    y = torch.empty(batch, channels, dtype=x.dtype, device=x.device)
    block_c = min(triton.next_power_of_2(channels), 256)
    _conv_update_kernel[(batch, triton.cdiv(channels, block_c))](
        x, weight, bias if bias is not None else weight, conv_state, slot_ids, y, channels, x.stride(0),
        conv_state.stride(0), conv_state.stride(1),
        K=width, HAS_BIAS=bias is not None, SILU=silu, BC=block_c, BK=triton.next_power_of_2(width),
    )
    return y
