"""Triton fused minGRU / minLSTM decode step: gates, recurrence and state write in one kernel.

Reads the projected inputs ``proj [B, P * D]`` and each row's state slot, writes the new state in place and
the new hidden state ``[B, D]`` in ``proj``'s dtype for the output projection.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _softplus(x):
    return tl.maximum(x, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(x)))


@triton.jit
def _g(x):
    return tl.where(x >= 0, x + 0.5, tl.sigmoid(x))


@triton.jit
def _min_rnn_step_kernel(
    proj_ptr, state_ptr, slot_ids_ptr, out_ptr, dim, stride_proj, stride_slot,
    IS_LSTM: tl.constexpr, BD: tl.constexpr,
):
    i_b = tl.program_id(0)
    offs = tl.program_id(1) * BD + tl.arange(0, BD)
    mask = offs < dim
    row = proj_ptr + i_b * stride_proj + offs
    slot = tl.load(slot_ids_ptr + i_b).to(tl.int64)
    state_ptrs = state_ptr + slot * stride_slot + offs
    if IS_LSTM:
        f = tl.load(row, mask=mask, other=0.0).to(tl.float32)
        i = tl.load(row + dim, mask=mask, other=0.0).to(tl.float32)
        candidate = tl.load(row + 2 * dim, mask=mask, other=0.0).to(tl.float32)
        diff = _softplus(-f) - _softplus(-i)
        a = tl.sigmoid(-diff)
        b = tl.sigmoid(diff) * _g(candidate)
    else:
        k = tl.load(row, mask=mask, other=0.0).to(tl.float32)
        candidate = tl.load(row + dim, mask=mask, other=0.0).to(tl.float32)
        z = tl.sigmoid(k)
        a = 1.0 - z
        b = z * _g(candidate)
    h = a * tl.load(state_ptrs, mask=mask, other=0.0) + b
    tl.store(state_ptrs, h, mask=mask)
    tl.store(out_ptr + i_b * dim + offs, h, mask=mask)


def min_rnn_step_triton(
    proj: torch.Tensor, state: torch.Tensor, slot_ids: torch.Tensor, cell: str
) -> torch.Tensor:
    """``proj [B, P * D]``, ``state [N, D]`` fp32 pool (channels contiguous) -> ``h [B, D]``, proj's dtype."""
    if cell not in ("mingru", "minlstm"):
        raise ValueError(f"unknown cell {cell!r}")
    batch, width = proj.shape
    dim = state.shape[-1]
    if width != (3 if cell == "minlstm" else 2) * dim:
        raise ValueError(f"{cell}: proj width {width} does not match state dim {dim}")
    if state.stride(-1) != 1:
        raise ValueError("state must be contiguous along its last dimension (it is updated in place)")
    proj = proj.contiguous()
    out = torch.empty(batch, dim, dtype=proj.dtype, device=proj.device)
    block_d = min(triton.next_power_of_2(dim), 1024)
    _min_rnn_step_kernel[(batch, triton.cdiv(dim, block_d))](
        proj, state, slot_ids, out, dim, proj.stride(0), state.stride(0),
        IS_LSTM=cell == "minlstm", BD=block_d,
    )
    return out
