"""Triton logit soft-capping for GPUs: ``cap * tanh(x / cap)`` from the LM head's output in its own dtype to fp32
logits, in one pass.

The PyTorch form on a GPU is four passes over the logits after the fp32 conversion (the division, ``tanh``, the
product, the copy into place): at batch 256 and a 256K vocabulary each pass moves 0.5 GB. Here each element is
read once in the head's dtype and written once in fp32. ``tanh`` as the CPU kernel computes it
(``soft_cap_cpu.cpp``): ``sign(t) (1 - e) / (1 + e)`` with ``e = exp(-2|t|)``, its Taylor polynomial to ``t^7``
below ``|t| = 1/8``, and 1 from ``|t| = 9.1``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096


@triton.jit
def _soft_cap_kernel(x_ptr, out_ptr, n, cap, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    t = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32) / cap
    a = tl.abs(t)
    e = tl.exp(-2.0 * a)
    t2 = t * t
    series = t * (1.0 + t2 * (-1.0 / 3.0 + t2 * (2.0 / 15.0 + t2 * (-17.0 / 315.0))))
    magnitude = tl.where(a >= 9.1, 1.0, (1.0 - e) / (1.0 + e))
    tanh = tl.where(a < 0.125, series, tl.where(t < 0.0, -magnitude, magnitude))
    tl.store(out_ptr + offsets, tanh * cap, mask=mask)


def soft_cap_triton(logits: torch.Tensor, cap: float) -> torch.Tensor:
    """``cap * tanh(logits / cap)`` of logits (fp32, bf16 or fp16; rows or columns contiguous) as new fp32 logits
    with the same strides."""
    out = torch.empty_like(logits, dtype=torch.float32)
    n = logits.numel()
    if n:
        _soft_cap_kernel[(triton.cdiv(n, BLOCK),)](logits, out, n, float(cap), BLOCK=BLOCK)
    return out
