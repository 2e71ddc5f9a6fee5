"""Weight-only int8 linear layer: ``x @ (weight * scale[:, None]).T + bias`` with an int8 ``weight [N, K]``,
one fp32 ``scale`` per output row, activations and output in the model's dtype and fp32 accumulation.

``naive.py`` is the reference (dequantize, then an fp32 matmul). ``int8_linear_cpu.cpp`` is the CPU kernel: for
up to 32 rows it streams the int8 weight once (4x fewer bytes than fp32) and converts it in registers; beyond
that it dequantizes cache-sized blocks of rows and multiplies them with the BLAS. ``fused.py`` is the Triton
kernel for CUDA (w8a16, ``tl.dot`` on the weight converted to the activations' dtype).
"""

from __future__ import annotations

import torch

from rnnserve.kernels.backend import unit_stride_last, use_triton
from rnnserve.kernels.cpu_extension import use_cpu_kernel
from rnnserve.kernels.int8_linear.naive import dequantize, int8_linear_ref

ACTIVATION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def int8_linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x [..., K]`` -> ``[..., N]`` in ``x``'s dtype: Triton on CUDA, the C++ kernel on CPU, else the reference.

    ``weight [N, K]`` int8 with a unit stride along K, ``scale [N]`` fp32, ``bias [N]`` (any float dtype) or None.
    The CPU kernel may return a transposed view for more than 32 rows.
    """
    if x.dtype not in ACTIVATION_DTYPES:
        raise TypeError(f"int8_linear takes fp32, bf16 or fp16 activations, got {x.dtype}")
    rows = x.reshape(-1, x.shape[-1])
    if use_triton(x):
        from rnnserve.kernels.int8_linear.fused import int8_linear_triton

        out = int8_linear_triton(unit_stride_last(rows), weight, scale, bias)
    elif use_cpu_kernel(x) and not (torch.is_grad_enabled() and x.requires_grad):
        out = torch.ops.rnnserve.int8_linear(rows, weight, scale, bias)
    else:
        out = int8_linear_ref(rows, weight, scale, bias)
    return out.reshape(*x.shape[:-1], weight.shape[0])


__all__ = ["dequantize", "int8_linear", "int8_linear_ref"]
