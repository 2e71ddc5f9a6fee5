"""Weight-only int4 linear layer: ``x @ W.T + bias`` with ``W`` stored in groups of 32 inputs, each group one fp16
scale and 32 signed 4-bit values (the layout of :mod:`.naive`: ``packed [N, G * 16]`` uint8, ``scale [N, G]``
fp16; 4.5 bits a weight), activations and output in the model's dtype and fp32 accumulation.

``naive.py`` is the reference (unpack, dequantize, an fp32 matmul). ``int4_linear_cpu.cpp`` is the CPU kernel: for
up to 32 rows it streams the packed weight once (about a seventh of fp32's bytes) and decodes it in registers; beyond
that it dequantizes cache-sized blocks of rows for the fp32 GEMM. ``fused.py`` is the Triton kernel for CUDA
(w4a16: ``tl.dot`` on the weight decoded to the activations' dtype).
"""

from __future__ import annotations

import torch

from rnnserve.kernels.backend import unit_stride_last, use_triton
from rnnserve.kernels.cpu_extension import use_cpu_kernel
from rnnserve.kernels.int4_linear.naive import GROUP, dequantize, groups_of, int4_linear_ref, pack, unpack

ACTIVATION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def int4_linear(
    x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x [..., K]`` -> ``[..., N]`` in ``x``'s dtype: Triton on CUDA, the C++ kernel on CPU, else the reference.

    ``packed [N, ceil(K / 32) * 16]`` uint8 with a unit stride along its columns, ``scale [N, ceil(K / 32)]``
    fp16 (contiguous), ``bias [N]`` (any float dtype) or None. The CPU kernel may return a transposed view for
    more than 32 rows.
    """
    if x.dtype not in ACTIVATION_DTYPES:
        raise TypeError(f"int4_linear takes fp32, bf16 or fp16 activations, got {x.dtype}")
    k = x.shape[-1]
    if packed.shape[1] != groups_of(k) * GROUP // 2 or scale.shape != (packed.shape[0], groups_of(k)):
        raise ValueError(
            f"int4_linear: {k} inputs need packed [N, {groups_of(k) * GROUP // 2}] and scale [N, {groups_of(k)}], "
            f"got {tuple(packed.shape)} and {tuple(scale.shape)}"
        )
    rows = x.reshape(-1, k)
    if use_triton(x):
        from rnnserve.kernels.int4_linear.fused import int4_linear_triton

        out = int4_linear_triton(unit_stride_last(rows), packed, scale, bias)
    elif use_cpu_kernel(x) and not (torch.is_grad_enabled() and x.requires_grad):
        out = torch.ops.rnnserve.int4_linear(rows, packed, scale, bias)
    else:
        out = int4_linear_ref(rows, packed, scale, bias)
    return out.reshape(*x.shape[:-1], packed.shape[0])


__all__ = ["GROUP", "dequantize", "groups_of", "int4_linear", "int4_linear_ref", "pack", "unpack"]
