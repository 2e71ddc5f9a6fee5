"""``x @ weight.T + bias`` for a few rows of ``x`` (a decode batch) on CPU, streaming the weight once.

``naive.py`` is the reference (fp32 math on the operands' values, one rounding). ``gemv_cpu.cpp`` gives each
thread a contiguous range of the weight's rows and reads each row from memory once, multiplying it with every
row of ``x`` in fp32 registers (bf16 weights are widened in registers, or on CPUs with AVX512-BF16 multiplied
as they are by ``vdpbf16ps``, in blocks of rows that stay in L2 while every chunk of ``x``'s rows passes, over
K in passes where the chunk's rows are long). It
applies to CPU tensors ``x [M, K]`` and ``weight [N, K]`` of one dtype, fp32 or bf16, with a unit stride along
``K`` and up to :data:`ROW_LIMITS` rows for that dtype (beyond them ATen's GEMM measured as fast or faster);
elsewhere the callers keep their ATen paths.

``ENABLED`` is read on every call: ``RNNSERVE_GEMV=0`` in the environment clears it at import, and clearing it
at run time brings back the previous paths in the same process (``benchmarks/cpu_decode.py`` compares both).

Beyond the kernel's rows, bf16 products go to ATen's GEMM, which is fast only on CPUs with bf16 arithmetic
(AVX512-BF16 or AMX); elsewhere it is 4-8x slower than converting both operands to fp32 and running the fp32 GEMM
(measured on an AVX2 EPYC from 65 to 2048 rows). :data:`UPCAST_BF16_GEMM` tells the callers to do that; the
result is the same product, accumulated in fp32 and rounded once. It is read on every call (benchmarks flip it).

Beyond the kernel's rows, fp32 products go to oneDNN's inner product where PyTorch has it
(:data:`ONEDNN_FP32_GEMM`, x86 builds): ATen's fp32 GEMM is MKL's, which runs its AVX2 code on AMD CPUs; oneDNN's
AVX-512 code was 2.0-2.3x faster there from 16 rows (a 2-core Zen 5), and with oneDNN held to AVX2 still level
with MKL at 16 rows and 1.1-1.4x from 33. It is read on every call as well.
"""

from __future__ import annotations

import os
import platform

import torch

from rnnserve.kernels.cpu_extension import use_cpu_kernel
from rnnserve.kernels.gemv.naive import gemv_ref

ENABLED = os.environ.get("RNNSERVE_GEMV", "1") != "0"


def native_bf16_gemm() -> bool:
    """Whether this CPU has bf16 arithmetic for ATen's bf16 GEMM (AVX512-BF16 or AMX tiles)."""
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, probe, lambda: False)() for probe in probes)


def onednn_fp32_gemm() -> bool:
    """Whether oneDNN's fp32 inner product (``torch.ops.mkldnn._linear_pointwise``) is in this PyTorch build."""
    return (
        platform.machine().lower() in {"x86_64", "amd64"}
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


UPCAST_BF16_GEMM = not native_bf16_gemm()
ONEDNN_FP32_GEMM = onednn_fp32_gemm()
AVX512 = torch.backends.cpu.get_cpu_capability().startswith("AVX512")
# Most rows per weight dtype (the op takes up to 64), measured against the GEMM that takes over beyond them.
# fp32 on AVX-512 (a 2-core Zen 5; decode of random:mamba-130m and mingru-100m with the limit at 8, 16, 24 and
# 64 in one process, docs/performance.md): ahead of oneDNN to 16 rows, level at 24, behind from 32 in one model of
# the two (against MKL, without oneDNN, 1.2-1.7x at 16 to 64 rows); with three rows of W at once (2026-11-29) 32
# and 64 rows gained 9% in mamba-130m and mamba2-130m but lost 10-23% in mingru-100m (K = 2048-4096 leaves 2-4
# rows of x per L1 chunk), so 24 stays (32 for weights of at most FP32_SHORT_K inputs, below). 12 is the
# crossover against MKL measured on AVX2 before the kernel took W's rows in L2 blocks, not measured again since.
# bf16 with bf16 arithmetic (the kernel's vdpbf16ps path, Zen 5):
# with three rows of W at once, 1.03-1.20x oneDNN's bf16 GEMM at 32 and 64 rows in mamba, mamba2, mingru and hawk
# decode; without bf16 arithmetic ATen's bf16 GEMM is slow at every row count.
ROW_LIMITS = {
    torch.float32: (24 if ONEDNN_FP32_GEMM else 64) if AVX512 else 12,
    torch.bfloat16: 64,
}


# fp32 on AVX-512 beside oneDNN, weights of at most FP32_SHORT_K inputs: the kernel to FP32_SHORT_K_ROWS rows of x
# (5-8 rows of x per 32 KB chunk meet its 3-row blocks of W; longer rows of W leave 2-4 and lose to oneDNN past 24
# rows). Zen 5, in one process alternating the rule, 32 / 64 streams with 64 rows: mamba2-130m 1.13x / 1.15x,
# lattice-110m 1.14x / 1.12x, hawk-100m 1.12x / 0.99x, mingru-100m 1.07x / 0.97x, mamba-130m 1.03x / 0.95x
# (48: 0.94x); with K <= 1024 instead, less at 32 and still behind at 64. So: to 32 rows, for rows of W that are
# whole cache lines (K a multiple of 16): each load of the others straddles two lines, and lstm-large (K = 1500)
# at 28-32 streams ran 1.08-1.11x faster on oneDNN (alternating in one process).
FP32_SHORT_K = 1536
FP32_SHORT_K_ROWS = 32


def row_limit(dtype: torch.dtype, k: int | None = None) -> int:
    """Most rows of ``x`` the kernel runs for weights of ``dtype`` with ``k`` inputs (0 when disabled or not
    supported)."""
    if not ENABLED:
        return 0
    short_rows = k is not None and k <= FP32_SHORT_K and k % 16 == 0
    if dtype == torch.float32 and AVX512 and ONEDNN_FP32_GEMM and short_rows:
        return FP32_SHORT_K_ROWS
    return ROW_LIMITS.get(dtype, 0)


def gemv_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`gemv` runs the CPU kernel for these operands (it has no autograd formula)."""
    return (
        x.dim() == 2
        and weight.dim() == 2
        and x.dtype == weight.dtype
        and 1 <= x.shape[0] <= row_limit(weight.dtype, weight.shape[1])
        and x.stride(1) == 1
        and weight.stride(1) == 1
        and weight.is_cpu
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
        and use_cpu_kernel(x)
    )


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias``: the kernel where :func:`gemv_applies` (a contiguous ``[M, N]`` result, fp32
    accumulation, one rounding), else the reference."""
    if gemv_applies(x, weight):
        return torch.ops.rnnserve.gemv(x, weight, bias)
    return gemv_ref(x, weight, bias)


__all__ = ["ENABLED", "ROW_LIMITS", "UPCAST_BF16_GEMM", "gemv", "gemv_applies", "native_bf16_gemm", "row_limit"]
