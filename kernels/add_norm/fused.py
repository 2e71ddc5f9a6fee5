"""Triton LayerNorm / RMSNorm fused with the residual add.

One program per row: one read of ``x`` and ``residual``, one write of the sum and of the normalised row.
Statistics in fp32. The sum is stored in the promoted dtype of ``x`` and ``residual`` (an fp32 residual stream
with bf16 activations stays fp32), the normalised row in ``x``'s dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, bias_ptr, out_ptr, sum_ptr, n, eps,
    HAS_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr, RMS: tl.constexpr, BN: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BN)
    mask = cols < n
    r = tl.load(x_ptr + row * n + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r += tl.load(residual_ptr + row * n + cols, mask=mask, other=0.0).to(tl.float32)
        # Normalise the sum as stored (rounded to the promoted dtype), like the unfused reference.
        r = r.to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * n + cols, r, mask=mask)
        r = r.to(tl.float32)
    r = tl.where(mask, r, 0.0)
    if RMS:
        centred = r
    else:
        centred = tl.where(mask, r - tl.sum(r, axis=0) / n, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(centred * centred, axis=0) / n + eps)
    y = centred * rstd * tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y += tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n + cols, y, mask=mask)


def add_norm_triton(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    rms: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of ``x [..., N]`` (+ ``residual``) -> ``(normed in x's dtype, summed in the promoted dtype)``."""
    n = x.shape[-1]
    x2d = x.reshape(-1, n).contiguous()
    out = torch.empty_like(x2d)
    if residual is None:
        summed = x
        residual2d = x2d
    else:
        residual2d = residual.reshape(-1, n).contiguous()
        summed = torch.empty(x2d.shape, dtype=torch.promote_types(x.dtype, residual.dtype), device=x.device)
    rows = x2d.shape[0]
    if rows:
        block_n = triton.next_power_of_2(n)
        _add_norm_kernel[(rows,)](
            x2d, residual2d, weight, bias if bias is not None else weight, out,
            summed if residual is not None else out, n, eps,
            HAS_RESIDUAL=residual is not None, HAS_BIAS=bias is not None, RMS=rms, BN=block_n,
            num_warps=min(max(block_n // 256, 1), 16),
        )
    return out.view(x.shape), summed.view(x.shape)
