"""Triton weight-only int8 linear (w8a16): int8 weight ``[N, K]``, per-row fp32 scale, fp32/fp16/bf16 activations.

One program per ``[BM, BN]`` block of the output: it walks K in ``BK`` steps, converts each int8 weight tile to the
activations' dtype (exact: every int8 value is representable in fp16 and bf16) and accumulates ``tl.dot`` products
in fp32; the scale and the bias are applied once, after the K loop, and the block is rounded once to the output
dtype. fp32 activations multiply in full fp32 (``ieee``), so the kernel matches the dequantize-then-matmul
reference up to summation order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rnnserve.kernels.backend import unit_stride_last


@triton.jit
def _int8_linear_kernel(
    x_ptr,
    w_ptr,
    scale_ptr,
    bias_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    HAS_BIAS: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    first_row = tl.program_id(0) * BM
    first_col = tl.program_id(1) * BN
    rows = tl.arange(0, BM)
    cols = tl.arange(0, BN)
    ks = tl.arange(0, BK)
    row_ok = first_row + rows < M
    col_ok = first_col + cols < N
    # 64-bit block offsets, 32-bit offsets within a block (fewer registers for the tiles' addresses).
    x_ptrs = x_ptr + first_row.to(tl.int64) * stride_xm + rows[:, None] * stride_xm + ks[None, :]
    w_ptrs = w_ptr + first_col.to(tl.int64) * stride_wn + cols[:, None] * stride_wn + ks[None, :]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        k_ok = k0 + ks < K
        x = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=col_ok[:, None] & k_ok[None, :], other=0)  # [BN, BK], contiguous along K
        acc = tl.dot(x.to(DOT_DTYPE), tl.trans(w.to(DOT_DTYPE)), acc, input_precision=PRECISION)  # [BM, BN]
        x_ptrs += BK
        w_ptrs += BK
    scale = tl.load(scale_ptr + first_col + cols, mask=col_ok, other=0.0)
    acc = acc * scale[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + first_col + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out_ptrs = y_ptr + first_row.to(tl.int64) * stride_ym + rows[:, None] * stride_ym + first_col + cols[None, :]
    tl.store(out_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


# No software pipelining of the K loop: with it, fp32 tiles need more registers than an sm_90 thread has (spills);
# several resident programs per SM hide the weight stream's latency instead.
NUM_STAGES = 1


def block_sizes(rows: int) -> tuple[int, int, int, int]:
    """``(BM, BN, BK, num_warps)``: decode batches (<= 16 rows) take 16-row tiles and long K steps, larger
    batches 64-row tiles (at most 128 registers a thread on sm_90, in fp32 and bf16)."""
    if rows <= 16:
        return 16, 64, 64, 8
    return 64, 64, 32, 8


def int8_linear_triton(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``x [M, K]`` (unit stride along K) -> ``[M, N]`` in ``x``'s dtype; ``weight [N, K]`` int8, ``scale [N]`` fp32
    (copied where the kernel's layout needs it: rows of unit stride, a contiguous scale and bias)."""
    rows, k = x.shape
    n = weight.shape[0]
    weight, scale = unit_stride_last(weight), scale.contiguous()
    bias = None if bias is None else bias.contiguous()
    y = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows == 0 or n == 0:
        return y
    dot_dtype = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}.get(x.dtype, tl.float32)
    block_m, block_n, block_k, warps = block_sizes(rows)
    grid = (triton.cdiv(rows, block_m), triton.cdiv(n, block_n))
    _int8_linear_kernel[grid](
        x,
        weight,
        scale,
        bias if bias is not None else scale,
        y,
        rows,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        y.stride(0),
        HAS_BIAS=bias is not None,
        DOT_DTYPE=dot_dtype,
        PRECISION="ieee" if dot_dtype == tl.float32 else "tf32",
        BM=block_m,
        BN=block_n,
        BK=block_k,
        num_warps=warps,
        num_stages=NUM_STAGES,
    )
    return y
