"""Triton RG-LRU decode step: both block-diagonal gates, the coefficients, the state update and the output gate
in one kernel, on state-pool slots in place.

One program owns one sequence, one head and ``BC`` of its channels: it reads the head's ``w`` conv outputs, the
``[w, BC]`` columns of both gate blocks, computes ``r``, ``i``, ``a`` and ``b`` with each rounding of
:func:`~rnnserve.kernels.rg_lru.naive.rg_lru_coefficients` (every op's result in the activations' dtype), reads
and writes its channels of the slot's fp32 state once and stores ``h * y``. Op by op this is about twenty
launches per layer (two batched matmuls, the sigmoids, softplus, exp, sqrt, selects, the scan step, the cast
and the product).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rnnserve.kernels.selective_scan.fused_recurrent import softplus_f32

CHANNELS = 32  # channels of one head a program


@triton.jit
def _rg_lru_step_kernel(
    x_ptr, y_ptr, first_ptr, wi_ptr, bi_ptr, wr_ptr, br_ptr, param_ptr, pool_ptr, slot_ids_ptr, out_ptr,
    width, dim, stride_x, stride_y, stride_slot,
    BW: tl.constexpr, BC: tl.constexpr,
):
    b = tl.program_id(0)
    head = tl.program_id(1)
    dtype = x_ptr.dtype.element_ty
    ks = tl.arange(0, BW)
    k_ok = ks < width
    cols = tl.program_id(2) * BC + tl.arange(0, BC)
    col_ok = cols < width
    chans = head * width + cols
    x_head = tl.load(x_ptr + b * stride_x + head * width + ks, mask=k_ok, other=0.0).to(tl.float32)
    block = head * width * width + ks[:, None] * width + cols[None, :]  # W[head, k, c]
    ok = k_ok[:, None] & col_ok[None, :]
    wi = tl.load(wi_ptr + block, mask=ok, other=0.0).to(tl.float32)
    wr = tl.load(wr_ptr + block, mask=ok, other=0.0).to(tl.float32)
    pre_i = tl.sum(x_head[:, None] * wi, axis=0) + tl.load(bi_ptr + chans, mask=col_ok, other=0.0).to(tl.float32)
    pre_r = tl.sum(x_head[:, None] * wr, axis=0) + tl.load(br_ptr + chans, mask=col_ok, other=0.0).to(tl.float32)
    gate_i = tl.sigmoid(pre_i.to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    gate_r = tl.sigmoid(pre_r.to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    param = tl.load(param_ptr + chans, mask=col_ok, other=0.0).to(tl.float32)
    log_a = ((-8.0 * gate_r).to(dtype).to(tl.float32) * softplus_f32(param).to(dtype).to(tl.float32)).to(dtype)
    log_a = log_a.to(tl.float32)
    decay = tl.exp(log_a).to(dtype).to(tl.float32)
    root = tl.sqrt((1.0 - tl.exp(2.0 * log_a).to(dtype).to(tl.float32)).to(dtype).to(tl.float32))
    first = tl.load(first_ptr + b) != 0
    multiplier = tl.where(first, 1.0, root.to(dtype).to(tl.float32))
    x = tl.load(x_ptr + b * stride_x + chans, mask=col_ok, other=0.0).to(tl.float32)
    gain = ((x * gate_i).to(dtype).to(tl.float32) * multiplier).to(dtype).to(tl.float32)
    decay = tl.where(first, 0.0, decay)
    slot = tl.load(slot_ids_ptr + b).to(tl.int64)
    h = tl.load(pool_ptr + slot * stride_slot + chans, mask=col_ok, other=0.0)
    h = decay * h + gain
    tl.store(pool_ptr + slot * stride_slot + chans, h, mask=col_ok)
    y = tl.load(y_ptr + b * stride_y + chans, mask=col_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + b * dim + chans, (h.to(dtype).to(tl.float32) * y).to(dtype), mask=col_ok)


def rg_lru_step_triton(
    x: torch.Tensor,
    y: torch.Tensor,
    first: torch.Tensor,
    input_gate_weight: torch.Tensor,
    input_gate_bias: torch.Tensor,
    recurrent_gate_weight: torch.Tensor,
    recurrent_gate_bias: torch.Tensor,
    recurrent_param: torch.Tensor,
    pool: torch.Tensor,
    slot_ids: torch.Tensor,
) -> torch.Tensor:
    """Same contract as :func:`~rnnserve.kernels.rg_lru.naive.rg_lru_step_ref`; ``x, y [B, D]`` with unit
    stride along ``D``, ``pool [N, D]`` fp32 with unit stride along ``D``."""
    if pool.dtype != torch.float32 or pool.stride(-1) != 1:
        raise ValueError("the RG-LRU pool must be fp32 with unit stride on its channels")
    batch, dim = x.shape
    heads, width, _ = input_gate_weight.shape
    x = x if x.stride(-1) == 1 else x.contiguous()
    y = y if y.stride(-1) == 1 else y.contiguous()
    out = torch.empty(batch, dim, dtype=x.dtype, device=x.device)
    if batch:
        block_c = min(CHANNELS, triton.next_power_of_2(width))
        _rg_lru_step_kernel[(batch, heads, triton.cdiv(width, block_c))](
            x, y, first.contiguous(), input_gate_weight.contiguous(), input_gate_bias.contiguous(),
            recurrent_gate_weight.contiguous(), recurrent_gate_bias.contiguous(), recurrent_param.contiguous(), pool,
            slot_ids.long().contiguous(), out, width, dim, x.stride(0), y.stride(0), pool.stride(0),
            BW=triton.next_power_of_2(width), BC=block_c, num_warps=4,
        )
    return out
