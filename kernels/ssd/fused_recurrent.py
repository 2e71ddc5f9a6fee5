"""Triton decode step for Mamba-2's SSD recurrence, on state-pool slots in place.

One program owns one sequence, one head and ``BP`` of its channels: it reads the ``[BP, N]`` state rows
of the sequence's slot once, applies ``S = exp(dt A) S + dt x B``, writes them back once and emits
``y = S C + D x``. Heads of one group share ``B`` and ``C``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rnnserve.kernels.backend import unit_stride_last


@triton.jit
def _ssd_state_update_kernel(
    state_ptr, slot_ids_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, y_ptr,
    heads, head_dim, d_state, heads_per_group,
    stride_slot, stride_state_h, stride_state_p, stride_x_b, stride_x_h, stride_dt,
    stride_B_b, stride_B_g, stride_C_b, stride_C_g,
    HAS_D: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
):
    i_b = tl.program_id(0)
    i_h = tl.program_id(1)
    i_p = tl.program_id(2)
    group = i_h // heads_per_group
    slot = tl.load(slot_ids_ptr + i_b).to(tl.int64)
    offs_p = i_p * BP + tl.arange(0, BP)
    offs_n = tl.arange(0, BN)
    mask_p = offs_p < head_dim
    mask_n = offs_n < d_state
    mask = mask_p[:, None] & mask_n[None, :]
    x = tl.load(x_ptr + i_b * stride_x_b + i_h * stride_x_h + offs_p, mask=mask_p, other=0.0).to(tl.float32)
    dt = tl.load(dt_ptr + i_b * stride_dt + i_h).to(tl.float32)
    decay = tl.exp(dt * tl.load(A_ptr + i_h).to(tl.float32))
    B = tl.load(B_ptr + i_b * stride_B_b + group * stride_B_g + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    C = tl.load(C_ptr + i_b * stride_C_b + group * stride_C_g + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    state_ptrs = (
        state_ptr + slot * stride_slot + i_h * stride_state_h + offs_p[:, None] * stride_state_p + offs_n[None, :]
    )
    s = tl.load(state_ptrs, mask=mask, other=0.0)
    s = decay * s + (dt * x)[:, None] * B[None, :]
    tl.store(state_ptrs, s, mask=mask)
    y = tl.sum(s * C[None, :], axis=1)
    if HAS_D:
        y += tl.load(D_ptr + i_h).to(tl.float32) * x
    tl.store(y_ptr + (i_b * heads + i_h) * head_dim + offs_p, y, mask=mask_p)


def ssd_state_update_triton(
    state: torch.Tensor,
    slot_ids: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
) -> torch.Tensor:
    """Advance pool rows ``state[slot_ids]`` (``[num_slots, H, P, N]`` fp32, unit stride on N) by one token in
    place; ``x [B, H, P]``, ``dt [B, H]`` (discretised), ``B, C [B, G, N]``; returns ``y [B, H, P]`` fp32."""
    if state.dtype != torch.float32 or state.stride(-1) != 1:
        raise ValueError("the state pool must be fp32 with unit stride on the state dimension")
    batch, heads, head_dim = x.shape
    groups, d_state = B.shape[1:]
    x, dt, B, C = unit_stride_last(x), unit_stride_last(dt), unit_stride_last(B), unit_stride_last(C)
    A = A.float().contiguous()
    D = None if D is None else D.float().contiguous()
    y = torch.empty(batch, heads, head_dim, dtype=torch.float32, device=x.device)
    block_n = triton.next_power_of_2(d_state)
    block_p = max(1, min(triton.next_power_of_2(head_dim), 2048 // block_n))
    grid = (batch, heads, triton.cdiv(head_dim, block_p))
    _ssd_state_update_kernel[grid](
        state, slot_ids.long().contiguous(), x, dt, A, B, C, D if D is not None else A, y,
        heads, head_dim, d_state, heads // groups,
        state.stride(0), state.stride(1), state.stride(2), x.stride(0), x.stride(1), dt.stride(0),
        B.stride(0), B.stride(1), C.stride(0), C.stride(1),
        HAS_D=D is not None, BP=block_p, BN=block_n,
    )
    return y
