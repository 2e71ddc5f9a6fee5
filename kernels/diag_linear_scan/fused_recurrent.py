"""Triton decode step for ``h = a * h + b``: reads and writes state slots in place, addressed by slot ids."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _diag_scan_step_kernel(
    a_ptr, b_ptr, state_ptr, slot_ids_ptr, out_ptr, dim, stride_slot,
    LOG_SPACE: tl.constexpr, BD: tl.constexpr,
):
    i_b = tl.program_id(0)
    offs_d = tl.program_id(1) * BD + tl.arange(0, BD)
    mask = offs_d < dim
    slot = tl.load(slot_ids_ptr + i_b).to(tl.int64)
    a = tl.load(a_ptr + i_b * dim + offs_d, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + i_b * dim + offs_d, mask=mask, other=0.0).to(tl.float32)
    if LOG_SPACE:
        a = tl.exp(a)
        b = tl.exp(b)
    state_ptrs = state_ptr + slot * stride_slot + offs_d
    h = a * tl.load(state_ptrs, mask=mask, other=0.0) + b
    tl.store(state_ptrs, h, mask=mask)
    tl.store(out_ptr + i_b * dim + offs_d, h, mask=mask)


def diag_scan_step_triton(
    a: torch.Tensor, b: torch.Tensor, state: torch.Tensor, slot_ids: torch.Tensor, log_space: bool
) -> torch.Tensor:
    """``a, b [B, D]``; ``state [N, D]`` fp32 (rows may be strided, channels contiguous) -> ``h [B, D]``."""
    batch, dim = a.shape
    if state.stride(-1) != 1:
        raise ValueError("state channels must be contiguous")
    a, b = a.contiguous(), b.contiguous()
    out = torch.empty(batch, dim, dtype=torch.float32, device=a.device)
    block_d = min(triton.next_power_of_2(dim), 1024)
    grid = (batch, triton.cdiv(dim, block_d))
    _diag_scan_step_kernel[grid](
        a, b, state, slot_ids, out, dim, state.stride(0), LOG_SPACE=log_space, BD=block_d
    )
    return out
