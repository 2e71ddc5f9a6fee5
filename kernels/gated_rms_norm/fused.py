"""Triton gated group RMSNorm of the Mamba-2 mixer, with the reference's rounding steps.

One program per (row, group): one read of ``y``, ``z`` (any row stride: ``z`` is a column slice of in_proj's
output) and the group's weights, one write of the output, instead of about seven PyTorch kernels over an fp32
``[T, d_inner]`` intermediate. ``silu(z)`` is ``z / (1 + exp(-z))`` with a correctly rounded division as
PyTorch computes it; the statistics are fp32 (summed in another order than PyTorch's, so the scale may move by
an ulp); the normalised value is rounded to ``z``'s dtype before the product with the weight, which is rounded
once to the output dtype, at the same points as
:func:`~rnnserve.kernels.gated_rms_norm.naive.gated_rms_norm_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rnnserve.kernels.backend import unit_stride_last


@triton.jit
def _gated_rms_norm_kernel(
    y_ptr, z_ptr, weight_ptr, out_ptr, width, inv_width, eps, stride_y, stride_z, stride_out,
    BN: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * width + tl.arange(0, BN)
    mask = tl.arange(0, BN) < width
    z = tl.load(z_ptr + row * stride_z + cols, mask=mask, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + row * stride_y + cols, mask=mask, other=0.0).to(tl.float32)
    gated = y * tl.math.div_rn(z, 1.0 + tl.exp(-z))
    rstd = tl.rsqrt(tl.sum(gated * gated, axis=0) * inv_width + eps)
    normed = (gated * rstd).to(z_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


def gated_rms_norm_triton(
    y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, groups: int, eps: float
) -> torch.Tensor:
    """``y, z [..., D]`` (last dimension contiguous, rows any stride), ``weight [D]`` -> ``[..., D]`` contiguous
    in ``promote_types(weight.dtype, z.dtype)``; see the reference for the semantics."""
    dim = z.shape[-1]
    if dim % groups:
        raise ValueError(f"width {dim} is not a multiple of {groups} groups")
    y2d, z2d = unit_stride_last(y.reshape(-1, dim)), unit_stride_last(z.reshape(-1, dim))
    rows = z2d.shape[0]
    out = torch.empty(rows, dim, dtype=torch.promote_types(weight.dtype, z.dtype), device=z.device)
    width = dim // groups
    if rows:
        block_n = triton.next_power_of_2(width)
        _gated_rms_norm_kernel[(rows, groups)](
            y2d, z2d, weight.contiguous(), out, width, 1.0 / width, eps, y2d.stride(0), z2d.stride(0), out.stride(0),
            BN=block_n, num_warps=min(max(block_n // 256, 1), 16),
        )
    return out.view(z.shape)
