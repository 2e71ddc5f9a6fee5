"""Triton weight-only int4 linear (w4a16): the group-wise layout of :mod:`.naive` (``packed [N, G * 16]`` uint8,
``scale [N, G]`` fp16), fp32/fp16/bf16 activations.

One program per ``[BM, BN]`` block of the output walks K one group of 32 inputs at a time. It unpacks the group's
16 bytes of each of its weight rows into their 32 values in the order low, high nibble of each byte (that of
``tl.join``), reads ``x``'s columns in the same order, and accumulates in fp32 one ``tl.dot`` of ``x`` and the
weights ``q * scale`` rounded to the activations' dtype: the reference's weights, up to summation order. The bias
is added once, after the K loop, and the block is rounded once to the output dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rnnserve.kernels.backend import unit_stride_last


@triton.jit
def _int4_linear_kernel(
    x_ptr,
    w_ptr,
    scale_ptr,
    bias_ptr,
    y_ptr,
    M,
    N,
    K,
    G,
    stride_xm,
    stride_wn,
    stride_ym,
    HAS_BIAS: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
):
    first_row = tl.program_id(0) * BM
    first_col = tl.program_id(1) * BN
    rows = tl.arange(0, BM)
    cols = tl.arange(0, BN)
    pairs = tl.arange(0, 32)
    x_cols = pairs // 2 + (pairs % 2) * 16  # the input of each unpacked value: byte j's nibbles are j and j + 16
    row_ok = first_row + rows < M
    col_ok = first_col + cols < N
    x_ptrs = x_ptr + first_row.to(tl.int64) * stride_xm + rows[:, None] * stride_xm + x_cols[None, :]
    w_ptrs = w_ptr + first_col.to(tl.int64) * stride_wn + cols[:, None] * stride_wn + tl.arange(0, 16)[None, :]
    scale_ptrs = scale_ptr + (first_col + cols).to(tl.int64) * G
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for g in range(0, G):
        x = tl.load(x_ptrs, mask=row_ok[:, None] & (g * 32 + x_cols < K)[None, :], other=0.0)
        packed = tl.load(w_ptrs, mask=col_ok[:, None], other=0x88).to(tl.int16)  # [BN, 16]
        q = tl.join((packed & 15) - 8, (packed >> 4) - 8).reshape(BN, 32)
        scale = tl.load(scale_ptrs + g, mask=col_ok, other=0.0).to(tl.float32)
        w = (q.to(tl.float32) * scale[:, None]).to(DOT_DTYPE)
        acc = tl.dot(x.to(DOT_DTYPE), tl.trans(w), acc, input_precision=PRECISION)  # [BM, BN]
        x_ptrs += 32
        w_ptrs += 16
    if HAS_BIAS:
        acc += tl.load(bias_ptr + first_col + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out_ptrs = y_ptr + first_row.to(tl.int64) * stride_ym + rows[:, None] * stride_ym + first_col + cols[None, :]
    tl.store(out_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def block_sizes(rows: int, fp32: bool) -> tuple[int, int, int]:
    """``(BM, BN, num_warps)``: 16-row tiles for decode batches (<= 16 rows), larger ones beyond; at most 128
    registers a thread on sm_90. fp32 activations take smaller tiles per warp: their ``ieee`` products run on the
    FMA units with the operands in registers (16 x 64 tiles on 4 warps took 255 registers)."""
    if fp32:
        return (16, 32, 8) if rows <= 16 else (32, 64, 16)
    return (16, 64, 4) if rows <= 16 else (64, 64, 8)


def int4_linear_triton(
    x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``x [M, K]`` (unit stride along K) -> ``[M, N]`` in ``x``'s dtype; ``packed [N, G * 16]`` uint8 and
    ``scale [N, G]`` fp16 (copied where the kernel's layout needs it: columns of unit stride, a contiguous scale
    and bias)."""
    rows, k = x.shape
    n, groups = scale.shape
    packed, scale = unit_stride_last(packed), scale.contiguous()
    bias = None if bias is None else bias.contiguous()
    y = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows == 0 or n == 0:
        return y
    dot_dtype = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}.get(x.dtype, tl.float32)
    block_m, block_n, warps = block_sizes(rows, dot_dtype == tl.float32)
    grid = (triton.cdiv(rows, block_m), triton.cdiv(n, block_n))
    _int4_linear_kernel[grid](
        x,
        packed,
        scale,
        bias if bias is not None else scale,
        y,
        rows,
        n,
        k,
        groups,
        x.stride(0),
        packed.stride(0),
        y.stride(0),
        HAS_BIAS=bias is not None,
        DOT_DTYPE=dot_dtype,
        PRECISION="ieee" if dot_dtype == tl.float32 else "tf32",
        BM=block_m,
        BN=block_n,
        num_warps=warps,
    )
    return y
