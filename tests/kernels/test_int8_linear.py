"""The int8 linear kernels (C++ on CPU, Triton under the interpreter) equal dequantize-then-matmul."""

from __future__ import annotations

import pytest
import torch

from rnnserve.engine.loader import load_model
from rnnserve.engine.models.base import DecodeBatch, PrefillBatch
from rnnserve.engine.quantize import quantize_model, quantize_weight
from rnnserve.engine.state_pool import StatePool
from rnnserve.kernels.backend import force_triton
from rnnserve.kernels.cpu_extension import cpu_ops
from rnnserve.kernels.int8_linear import int8_linear
from rnnserve.kernels.int8_linear.naive import dequantize, int8_linear_ref
from tests.kernels.kernel_cases import count_calls

needs_cpu_kernels = pytest.mark.skipif(not cpu_ops(), reason="needs the fused CPU kernels")

# (K, N): odd sizes below and across the 8- and 16-lane vectors and the 64-weight steps, a projection-sized one,
# one long enough that fp32 rows of x go 2 at a time (L1), and one that chunks of x take over K in passes (bf16
# from 3 rows, fp32 from 8; the last pass not a whole line).
SHAPES = [(64, 48), (33, 17), (7, 40), (130, 9), (101, 11), (1, 5), (768, 100), (3000, 7), (8200, 13)]
ROWS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 17, 32, 33, 40]  # one weight row at a time up to 8, 8-row chunks to 32, then GEMM


def operands(rows: int, k: int, n: int, dtype: torch.dtype, bias_dtype: torch.dtype | None, seed: int = 0):
    g = torch.Generator().manual_seed(seed * 7919 + rows * 1000 + k * 10 + n)
    weight, scale = quantize_weight(torch.randn(n, k, generator=g) / k**0.5)
    x = torch.randn(rows, k, generator=g).to(dtype)
    bias = None if bias_dtype is None else torch.randn(n, generator=g).to(bias_dtype)
    return x, weight, scale, bias


def assert_matches_reference(out: torch.Tensor, x, weight, scale, bias) -> None:
    """fp32: equal up to summation order. bf16/fp16: the same fp32 result rounded once, so at most one rounding
    step apart (a summation-order difference may cross a rounding boundary); two under Triton's interpreter,
    whose fp32 -> bf16 casts truncate where torch and a GPU round to nearest."""
    expected = int8_linear_ref(x, weight, scale, bias)
    assert out.dtype == x.dtype and out.shape == expected.shape
    if x.dtype == torch.float32:
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(out.float(), expected.float(), rtol=2 * torch.finfo(x.dtype).eps, atol=1e-5)


def test_reference_is_dequantize_then_matmul() -> None:
    x, weight, scale, bias = operands(4, 24, 12, torch.float32, torch.float32)
    expected = x @ (weight.float() * scale[:, None]).t() + bias
    torch.testing.assert_close(int8_linear_ref(x, weight, scale, bias), expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dequantize(weight, scale), weight.float() * scale[:, None])


@needs_cpu_kernels
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(("k", "n"), SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias_dtype", [None, torch.float32, torch.bfloat16])
def test_cpu_kernel_matches_reference(rows: int, k: int, n: int, dtype: torch.dtype, bias_dtype) -> None:
    x, weight, scale, bias = operands(rows, k, n, dtype, bias_dtype)
    assert_matches_reference(torch.ops.rnnserve.int8_linear(x, weight, scale, bias), x, weight, scale, bias)


@needs_cpu_kernels
@pytest.mark.parametrize("rows", [1, 6, 12, 64])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cpu_kernel_fp16_and_strided_operands(rows: int, dtype: torch.dtype) -> None:
    """fp16 and bf16 activations; rows of x and of the weight wider than K (slices of bigger tensors) are read
    in place."""
    g = torch.Generator().manual_seed(rows)
    wide_x = torch.randn(rows, 300, generator=g).to(dtype)
    x = wide_x[:, 40:169]
    weight_full, scale = quantize_weight(torch.randn(23, 200, generator=g))
    weight = weight_full[:, 50:179]
    assert x.stride(0) == 300 and weight.stride(0) == 200
    assert_matches_reference(torch.ops.rnnserve.int8_linear(x, weight, scale, None), x, weight, scale, None)


@needs_cpu_kernels
def test_large_batch_path_matches_reference() -> None:
    """Prefill-sized inputs go through the blocked dequantize + GEMM path (several weight blocks)."""
    x, weight, scale, bias = operands(300, 1100, 700, torch.float32, torch.float32)
    assert_matches_reference(torch.ops.rnnserve.int8_linear(x, weight, scale, bias), x, weight, scale, bias)


@pytest.mark.parametrize("shape", [(5, 64), (2, 3, 64), (0, 64)])
def test_public_function_keeps_leading_dimensions(shape: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(0)
    weight, scale = quantize_weight(torch.randn(10, 64, generator=g))
    x = torch.randn(*shape, generator=g)
    out = int8_linear(x, weight, scale)
    assert out.shape == (*shape[:-1], 10)
    expected = int8_linear_ref(x.reshape(-1, 64), weight, scale).reshape(out.shape)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_rejects_integer_activations() -> None:
    weight, scale = quantize_weight(torch.randn(4, 8))
    with pytest.raises(TypeError, match="activations"):
        int8_linear(torch.ones(2, 8, dtype=torch.int32), weight, scale)


@pytest.mark.parametrize("rows", [1, 3, 16, 17, 40])
@pytest.mark.parametrize(("k", "n"), [(64, 48), (33, 17), (200, 130)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("has_bias", [False, True])
def test_triton_kernel_matches_reference(triton_on_cpu, rows: int, k: int, n: int, dtype, has_bias: bool) -> None:
    """Under the interpreter (the int8 weights' conversion to bf16 and bf16's tl.dot as a GPU computes them:
    tests/kernels/interpreter_bf16.py)."""
    x, weight, scale, bias = operands(rows, k, n, dtype, dtype if has_bias else None, seed=1)
    assert_matches_reference(int8_linear(x, weight, scale, bias), x, weight, scale, bias)


def test_triton_kernel_takes_strided_weights_and_bias(triton_on_cpu) -> None:
    """A weight with strided columns and a strided bias are copied into the kernel's layout (they were read as if
    contiguous: wrong numbers, no error)."""
    g = torch.Generator().manual_seed(4)
    weight, scale = quantize_weight(torch.randn(20, 64, generator=g))
    wide = torch.zeros(20, 128, dtype=torch.int8)
    wide[:, ::2] = weight
    bias = torch.randn(20, 2, generator=g)[:, 0]
    x = torch.randn(3, 64, generator=g)
    assert_matches_reference(int8_linear(x, wide[:, ::2], scale, bias), x, weight, scale, bias.contiguous())


@needs_cpu_kernels
@pytest.mark.parametrize("rows", [3, 40])
def test_no_inputs_gives_the_bias(rows: int) -> None:
    """K = 0: the bias (the GEMM path gave oneDNN an empty product it has no primitive for)."""
    weight, scale = torch.zeros(7, 0, dtype=torch.int8), torch.ones(7)
    bias = torch.randn(7)
    out = torch.ops.rnnserve.int8_linear(torch.zeros(rows, 0), weight, scale, bias)
    torch.testing.assert_close(out, bias.expand(rows, 7))


def test_triton_kernel_reads_strided_rows(triton_on_cpu) -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 100, generator=g)[:, 10:74]
    weight, scale = quantize_weight(torch.randn(20, 64, generator=g))
    assert_matches_reference(int8_linear(x, weight, scale), x, weight, scale, None)


@pytest.mark.parametrize("preset", ["mamba2-tiny", "mingru-tiny"])
def test_quantized_model_with_triton_kernels_matches_cpu_path(triton_on_cpu, monkeypatch, preset: str) -> None:
    """An int8 model runs its linear layers through the Triton kernel when the kernels are forced (the CUDA path)
    and gives the logits of the CPU path: prefill, then a batched decode step."""
    calls = count_calls(monkeypatch, [("rnnserve.kernels.int8_linear.fused", "int8_linear_triton")])
    model, _ = load_model(f"random:{preset}", device="cpu")
    quantize_model(model, "int8")
    g = torch.Generator().manual_seed(2)
    chunks = [torch.randint(0, 256, (n,), generator=g) for n in (3, 19)]
    logits = {}
    for forced in (True, False):
        pool = StatePool(model.state_spec(), 3)
        with torch.inference_mode(), force_triton(forced):
            prefill = model.prefill(PrefillBatch.build(chunks, [2, 0], all_logits=[True, True]), pool.tensors)
            decode = model.decode(DecodeBatch.build([7, 9], [2, 0], [3, 19]), pool.tensors)
        logits[forced] = torch.cat([prefill, decode])
    assert calls["int8_linear_triton"] > 0
    torch.testing.assert_close(logits[True], logits[False], rtol=1e-4, atol=1e-4)
