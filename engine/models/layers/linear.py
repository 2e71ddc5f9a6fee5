"""Linear layers with CPU fast paths for decode batches and small prefill chunks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rnnserve.engine.quantize import Int8Linear
from rnnserve.kernels import gemv
from rnnserve.kernels.gemv import gemv_applies
from rnnserve.kernels.int8_linear import int8_linear
from rnnserve.kernels.skinny_linear import skinny_linear_applies

SMALL_BATCH_ROWS = 128


def linear(layer: nn.Linear | Int8Linear, x: torch.Tensor) -> torch.Tensor:
    """``layer(x)``, through :func:`matmul_t`'s fast paths for few rows (int8 layers: their own kernel)."""
    if isinstance(layer, Int8Linear):
        return int8_linear(x, layer.weight, layer.scale, layer.bias)
    return matmul_t(x, layer.weight, layer.bias)


def matmul_t(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias``, with three CPU paths for decode batches and small prefill chunks:

    * bf16, 1..32 rows, on CPUs with AMX: the :mod:`rnnserve.kernels.skinny_linear` kernel, which reads the weight
      as stored at memory speed (about 2x oneDNN at 1-32 rows);
    * up to :data:`rnnserve.kernels.gemv.ROW_LIMITS` rows otherwise (fp32 12, or 64 on AVX-512; bf16 64, or 31
      with bf16 arithmetic): the :mod:`rnnserve.kernels.gemv` kernel, which streams the weight once on all cores
      (1.1-1.9x ATen in fp32, 1.2-10x in bf16 on an AVX2 CPU; 1.2-3.3x a decode step on a Zen 5);
    * bf16 beyond those rows on CPUs without bf16 arithmetic (:data:`rnnserve.kernels.gemv.UPCAST_BF16_GEMM`):
      the fp32 GEMM of the upcast operands, rounded once to bf16 (4-8x ATen's bf16 GEMM there);
    * 2..128 rows otherwise: ``(W @ x^T)^T``. With few rows, MKL/oneDNN repack the weight for ``x @ W^T``
      on every call; ``W @ x^T`` streams it as stored instead: 1.4-1.8x faster in fp32 and 1.5-2.5x in
      bf16 at 8-64 rows on these CPUs. The result is a transposed view.
    """
    if x.device.type != "cpu" or x.dim() != 2:
        return F.linear(x, weight, bias)
    if skinny_linear_applies(x, weight):
        return torch.ops.rnnserve.skinny_linear(x, weight, bias)
    if gemv_applies(x, weight):
        return torch.ops.rnnserve.gemv(x, weight, bias)
    if gemv.UPCAST_BF16_GEMM and x.dtype == weight.dtype == torch.bfloat16:
        return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(torch.bfloat16)
    if not 2 <= x.shape[0] <= SMALL_BATCH_ROWS:
        return F.linear(x, weight, bias)
    out = torch.mm(weight, x.t()).t()
    return out if bias is None else out + bias
