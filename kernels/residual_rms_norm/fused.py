"""Triton residual add + RMSNorm of a Mamba / Mamba-2 block, with the reference's rounding steps.

One program per row: one read of the stream and of the block's output, one write of the new stream and of
the normed row. Each rounding of :func:`~rnnserve.kernels.residual_rms_norm.naive.residual_rms_norm_ref` is a
cast to the same dtype at the same point; the statistics are fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def residual_rms_norm_row(
    stream_ptr, delta_ptr, weight_ptr, normed_ptr, new_stream_ptr, row, n, eps, stride_stream, stride_delta,
    HAS_DELTA: tl.constexpr, ROUND_TO_WEIGHT: tl.constexpr, BN: tl.constexpr, CACHE: tl.constexpr,
):
    """One row of :func:`residual_rms_norm_triton` (``row`` int64): the kernel's body, and a persistent decode
    stack's last phase, which reads the stream and ``delta`` with ``CACHE = ".cg"`` (other programs of its launch
    wrote them; ``""`` elsewhere)."""
    cols = tl.arange(0, BN)
    mask = cols < n
    stream_dtype = stream_ptr.dtype.element_ty
    weight_dtype = weight_ptr.dtype.element_ty
    s = tl.load(stream_ptr + row * stride_stream + cols, mask=mask, other=0.0, cache_modifier=CACHE)
    if HAS_DELTA:
        d = tl.load(delta_ptr + row * stride_delta + cols, mask=mask, other=0.0, cache_modifier=CACHE)
        d = d.to(stream_dtype)
        s = (s.to(tl.float32) + d.to(tl.float32)).to(stream_dtype)  # the add in the stream's dtype
        tl.store(new_stream_ptr + row * n + cols, s, mask=mask)
    norm_dtype = weight_dtype if ROUND_TO_WEIGHT else stream_dtype  # the dtype the norm's input is rounded to
    x = s.to(norm_dtype).to(tl.float32)
    y = (x * tl.rsqrt(tl.sum(x * x, axis=0) / n + eps)).to(norm_dtype)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(normed_ptr + row * n + cols, (w * y.to(tl.float32)).to(weight_dtype), mask=mask)


@triton.jit
def _residual_rms_norm_kernel(
    stream_ptr, delta_ptr, weight_ptr, normed_ptr, new_stream_ptr, n, eps, stride_stream, stride_delta,
    HAS_DELTA: tl.constexpr, ROUND_TO_WEIGHT: tl.constexpr, BN: tl.constexpr,
):
    residual_rms_norm_row(stream_ptr, delta_ptr, weight_ptr, normed_ptr, new_stream_ptr,
                          tl.program_id(0).to(tl.int64), n, eps, stride_stream, stride_delta, HAS_DELTA,
                          ROUND_TO_WEIGHT, BN, "")


def residual_rms_norm_triton(
    stream: torch.Tensor,
    delta: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    round_to_weight_dtype: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of ``stream [..., N]`` (+ ``delta``) -> ``(normed in weight's dtype, new_stream)``; see the
    reference for the semantics."""
    n = stream.shape[-1]
    stream2d = stream.reshape(-1, n)
    if stream2d.stride(-1) != 1:
        stream2d = stream2d.contiguous()
    rows = stream2d.shape[0]
    normed = torch.empty(rows, n, dtype=weight.dtype, device=stream.device)
    new_stream = stream2d if delta is None else torch.empty(rows, n, dtype=stream.dtype, device=stream.device)
    delta2d = stream2d
    if delta is not None:
        delta2d = delta.reshape(-1, n)
        if delta2d.stride(-1) != 1:
            delta2d = delta2d.contiguous()
    if rows:
        block_n = triton.next_power_of_2(n)
        _residual_rms_norm_kernel[(rows,)](
            stream2d, delta2d, weight.contiguous(), normed, new_stream, n, eps, stream2d.stride(0),
            delta2d.stride(0), HAS_DELTA=delta is not None, ROUND_TO_WEIGHT=round_to_weight_dtype, BN=block_n,
            num_warps=min(max(block_n // 256, 1), 16),
        )
    return normed.view(stream.shape), stream if delta is None else new_stream.view(stream.shape)
