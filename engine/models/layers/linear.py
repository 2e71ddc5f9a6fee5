"""Linear layers with CPU fast paths for decode batches and small prefill chunks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rnnserve.engine.quantize import Int4Linear, Int8Linear, QuantizedLinear
from rnnserve.kernels import gemv
from rnnserve.kernels.gemv import gemv_applies
from rnnserve.kernels.int4_linear import int4_linear
from rnnserve.kernels.int8_linear import int8_linear
from rnnserve.kernels.skinny_linear import skinny_linear_applies

SMALL_BATCH_ROWS = 128
ONEDNN_ROW_BITS = 3  # oneDNN multiplies 2**3 row counts per doubling of the rows (see onednn_rows)


def linear(layer: nn.Linear | QuantizedLinear, x: torch.Tensor, widened: bool = False) -> torch.Tensor:
    """``layer(x)``, through :func:`matmul_t`'s fast paths for few rows (quantized layers: their own kernels,
    never widened)."""
    if isinstance(layer, Int8Linear):
        return int8_linear(x, layer.weight, layer.scale, layer.bias)
    if isinstance(layer, Int4Linear):
        return int4_linear(x, layer.weight, layer.scale, layer.bias)
    return matmul_t(x, layer.weight, layer.bias, widened)


def matmul_t(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, widened: bool = False
) -> torch.Tensor:
    """``x @ weight.T + bias``, with these CPU paths for decode batches and prefill chunks:

    * bf16, 1..32 rows, on CPUs with AMX: the :mod:`rnnserve.kernels.skinny_linear` kernel, which reads the weight
      as stored at memory speed (about 2x oneDNN at 1-32 rows);
    * up to :func:`rnnserve.kernels.gemv.row_limit` rows otherwise (fp32 12, or on AVX-512 24 before oneDNN,
      32 for weights of at most 1536 inputs in whole cache lines, and 64 without it; bf16 64): the
      :mod:`rnnserve.kernels.gemv` kernel, which streams the weight once on all cores (1.1-1.9x ATen in fp32,
      1.2-10x in bf16 on an AVX2 CPU; 1.2-3.3x a decode step on a Zen 5);
    * bf16 beyond those rows on CPUs without bf16 arithmetic (:data:`rnnserve.kernels.gemv.UPCAST_BF16_GEMM`):
      the fp32 GEMM of the upcast operands, rounded once to bf16 (4-8x ATen's bf16 GEMM there);
    * fp32 beyond those rows where PyTorch has oneDNN (:data:`rnnserve.kernels.gemv.ONEDNN_FP32_GEMM`): oneDNN's
      inner product (ATen's fp32 GEMM is MKL's, which takes its AVX2 code on AMD CPUs: 2.0-2.3x on a Zen 5), on
      rows padded to :func:`onednn_rows`;
    * 2..128 rows otherwise: ``(W @ x^T)^T``. With few rows, MKL/oneDNN repack the weight for ``x @ W^T``
      on every call; ``W @ x^T`` streams it as stored instead: 1.4-1.8x faster in fp32 and 1.5-2.5x in
      bf16 at 8-64 rows on these CPUs. The result is a transposed view.

    ``widened`` is for an LM head, whose output its caller makes fp32 logits: where the GEMV kernel takes a bf16
    product, its result comes widened to fp32 (the same bf16-rounded values), written once instead of as bf16 and
    then converted (for a 256K vocabulary at 32 rows the conversion cost a fifth of the head's own product).
    Elsewhere the result is the same as without it.
    """
    if not x.is_cpu or x.dim() != 2:
        return F.linear(x, weight, bias)
    if skinny_linear_applies(x, weight):
        return torch.ops.rnnserve.skinny_linear(x, weight, bias)
    if gemv_applies(x, weight):
        kernel = torch.ops.rnnserve.gemv_widened if widened and x.dtype == torch.bfloat16 else torch.ops.rnnserve.gemv
        return kernel(x, weight, bias)
    if gemv.UPCAST_BF16_GEMM and x.dtype == weight.dtype == torch.bfloat16:
        return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(torch.bfloat16)
    if gemv.ONEDNN_FP32_GEMM and onednn_applies(x, weight, bias):
        return onednn_linear(x, weight, bias)
    if not 2 <= x.shape[0] <= SMALL_BATCH_ROWS:
        return F.linear(x, weight, bias)
    out = torch.mm(weight, x.t()).t()
    return out if bias is None else out + bias


def onednn_rows(rows: int) -> int:
    """The row count oneDNN multiplies for ``rows`` rows: rounded up to one of ``2**ONEDNN_ROW_BITS`` steps per
    doubling (at most 1/8 more rows). oneDNN builds (JIT-compiles)
    and caches a primitive per shape, ~250 KB each, in caches of 1024 entries: every row count of a prefill's
    packed chunks was a shape of its own, and a CPU server's heap grew by hundreds of MB of primitives, then kept
    growing as the caches evicted and rebuilt them (the freed holes fragment glibc's heap, which the server never
    trims). Bucketed, a weight shape has ~8 row counts per doubling."""
    step = 1 << max(0, rows.bit_length() - 1 - ONEDNN_ROW_BITS)
    return -(-rows // step) * step


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's fp32 inner product of ``x`` padded with zero rows to :func:`onednn_rows` (the result's rows
    beyond ``x``'s are left out: a contiguous view)."""
    rows = x.shape[0]
    padding = onednn_rows(rows) - rows
    if not padding:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return torch.ops.mkldnn._linear_pointwise(F.pad(x, (0, 0, 0, padding)), weight, bias, "none", [], "")[:rows]


def onednn_applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether oneDNN's fp32 inner product takes these operands (fp32 throughout; it has no autograd formula)."""
    return (
        x.dtype == weight.dtype == torch.float32
        and (bias is None or bias.dtype == torch.float32)
        and not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias)))
    )
