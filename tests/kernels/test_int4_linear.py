"""The int4 linear kernels (C++ on CPU, Triton under the interpreter) equal unpack-dequantize-then-matmul."""

from __future__ import annotations

import pytest
import torch

from rnnserve.engine.loader import load_model
from rnnserve.engine.models.base import DecodeBatch, PrefillBatch
from rnnserve.engine.quantize import quantize_model, quantize_weight_int4
from rnnserve.engine.state_pool import StatePool
from rnnserve.kernels.backend import force_triton
from rnnserve.kernels.cpu_extension import cpu_ops
from rnnserve.kernels.int4_linear import int4_linear
from rnnserve.kernels.int4_linear.naive import dequantize, int4_linear_ref, pack, unpack
from tests.kernels.kernel_cases import count_calls

needs_cpu_kernels = pytest.mark.skipif(not cpu_ops(), reason="needs the fused CPU kernels")

# (K, N): K below, at and across a group of 32 and a cache line of 4 groups (a last group padded, whole lines and
# single groups after them), a projection-sized one, and ones long enough that chunks of x take K in passes.
SHAPES = [(64, 48), (33, 17), (7, 40), (130, 9), (160, 11), (1, 5), (768, 100), (3000, 7), (8200, 13)]
ROWS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 17, 32, 33, 40]  # one weight row at a time up to 8, 8-row chunks to 32, then GEMM


def operands(rows: int, k: int, n: int, dtype: torch.dtype, bias_dtype: torch.dtype | None, seed: int = 0):
    g = torch.Generator().manual_seed(seed * 7919 + rows * 1000 + k * 10 + n)
    packed, scale = quantize_weight_int4(torch.randn(n, k, generator=g) / k**0.5)
    x = torch.randn(rows, k, generator=g).to(dtype)
    bias = None if bias_dtype is None else torch.randn(n, generator=g).to(bias_dtype)
    return x, packed, scale, bias


def assert_matches_reference(out: torch.Tensor, x, packed, scale, bias) -> None:
    """fp32: equal up to summation order. bf16/fp16: the same fp32 result rounded once, so at most one rounding
    step apart (a summation-order difference may cross a rounding boundary)."""
    expected = int4_linear_ref(x, packed, scale, bias)
    assert out.dtype == x.dtype and out.shape == expected.shape
    if x.dtype == torch.float32:
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(out.float(), expected.float(), rtol=2 * torch.finfo(x.dtype).eps, atol=1e-5)


def test_layout_and_reference() -> None:
    """Byte j of a group holds values j (low nibble) and j + 16 (high), offset by 8; the reference is the
    dequantized weight's fp32 matmul."""
    q = torch.arange(64).mul(5).remainder(16).sub(8).view(1, 64)
    packed = pack(q)
    assert packed.shape == (1, 32)
    for group in range(2):
        for j in range(16):
            low, high = q[0, 32 * group + j] + 8, q[0, 32 * group + j + 16] + 8
            assert packed[0, 16 * group + j] == low | (high << 4)
    assert torch.equal(unpack(packed), q.to(torch.int8))
    scale = torch.tensor([[0.5, -2.0]], dtype=torch.float16)
    weight = dequantize(packed, scale, 40)
    torch.testing.assert_close(weight, torch.cat([q[:, :32] * 0.5, q[:, 32:40] * -2.0], 1).float())
    x = torch.randn(3, 40)
    torch.testing.assert_close(int4_linear_ref(x, packed, scale), x @ weight.t())


@needs_cpu_kernels
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(("k", "n"), SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias_dtype", [None, torch.float32])
def test_cpu_kernel_matches_reference(rows: int, k: int, n: int, dtype: torch.dtype, bias_dtype) -> None:
    x, packed, scale, bias = operands(rows, k, n, dtype, bias_dtype)
    assert_matches_reference(torch.ops.rnnserve.int4_linear(x, packed, scale, bias), x, packed, scale, bias)


@needs_cpu_kernels
@pytest.mark.parametrize("rows", [1, 6, 12, 64])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cpu_kernel_fp16_and_strided_operands(rows: int, dtype: torch.dtype) -> None:
    """fp16 and bf16 activations with a bf16 bias; rows of x and of the packed weight wider than their data
    (slices of bigger tensors) are read in place."""
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 300, generator=g).to(dtype)[:, 40:169]
    packed_full, scale = quantize_weight_int4(torch.randn(23, 129, generator=g))
    packed = torch.cat([packed_full, packed_full[:, :8]], 1)[:, : packed_full.shape[1]]
    bias = torch.randn(23, generator=g).to(torch.bfloat16)
    assert x.stride(0) == 300 and packed.stride(0) == packed_full.shape[1] + 8
    assert_matches_reference(torch.ops.rnnserve.int4_linear(x, packed, scale, bias), x, packed, scale, bias)


@needs_cpu_kernels
def test_large_batch_path_matches_reference() -> None:
    """Prefill-sized inputs go through the blocked dequantize + GEMM path (several weight blocks, a padded group)."""
    x, packed, scale, bias = operands(300, 1100, 700, torch.float32, torch.float32)
    assert_matches_reference(torch.ops.rnnserve.int4_linear(x, packed, scale, bias), x, packed, scale, bias)


@needs_cpu_kernels
def test_cpu_kernel_rejects_mismatched_layouts() -> None:
    x, packed, scale, _ = operands(2, 64, 8, torch.float32, None)
    with pytest.raises(RuntimeError, match="scale must be"):
        torch.ops.rnnserve.int4_linear(x, packed, scale[:, :1].contiguous(), None)
    with pytest.raises(RuntimeError, match="packed must be"):
        torch.ops.rnnserve.int4_linear(x, packed[:, :16], scale, None)
    with pytest.raises(RuntimeError, match="fp16"):
        torch.ops.rnnserve.int4_linear(x, packed, scale.float(), None)


@needs_cpu_kernels
@pytest.mark.parametrize("rows", [3, 40])
def test_no_inputs_gives_the_bias(rows: int) -> None:
    """K = 0: the bias (the GEMM path gave oneDNN an empty product it has no primitive for)."""
    packed, scale = quantize_weight_int4(torch.zeros(7, 0))
    bias = torch.randn(7)
    out = torch.ops.rnnserve.int4_linear(torch.zeros(rows, 0), packed, scale, bias)
    torch.testing.assert_close(out, bias.expand(rows, 7))


def test_reference_and_quantizer_take_no_output_rows() -> None:
    packed, scale = quantize_weight_int4(torch.zeros(0, 40))
    assert packed.shape == (0, 32) and scale.shape == (0, 2)
    assert int4_linear_ref(torch.randn(3, 40), packed, scale).shape == (3, 0)


@pytest.mark.parametrize("shape", [(5, 64), (2, 3, 64), (0, 64)])
def test_public_function_keeps_leading_dimensions(shape: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(0)
    packed, scale = quantize_weight_int4(torch.randn(10, 64, generator=g))
    x = torch.randn(*shape, generator=g)
    out = int4_linear(x, packed, scale)
    assert out.shape == (*shape[:-1], 10)
    expected = int4_linear_ref(x.reshape(-1, 64), packed, scale).reshape(out.shape)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_public_function_rejects_integer_activations_and_wrong_widths() -> None:
    packed, scale = quantize_weight_int4(torch.randn(4, 64))
    with pytest.raises(TypeError, match="activations"):
        int4_linear(torch.ones(2, 64, dtype=torch.int32), packed, scale)
    with pytest.raises(ValueError, match="100 inputs need packed"):
        int4_linear(torch.ones(2, 100), packed, scale)


@pytest.mark.parametrize("rows", [1, 3, 16, 17, 40])
@pytest.mark.parametrize(("k", "n"), [(64, 48), (33, 17), (200, 130)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("has_bias", [False, True])
def test_triton_kernel_matches_reference(triton_on_cpu, rows: int, k: int, n: int, dtype, has_bias: bool) -> None:
    """Under the interpreter (bf16's tl.dot as a GPU computes it: tests/kernels/interpreter_bf16.py)."""
    x, packed, scale, bias = operands(rows, k, n, dtype, dtype if has_bias else None, seed=1)
    out = int4_linear(x, packed, scale, bias)
    if dtype == torch.bfloat16:
        assert_matches_reference_with_truncated_bf16_weights(out, x, packed, scale, bias)
    else:
        assert_matches_reference(out, x, packed, scale, bias)


def assert_matches_reference_with_truncated_bf16_weights(out: torch.Tensor, x, packed, scale, bias) -> None:
    """bf16 under Triton's interpreter, whose fp32 -> bf16 casts truncate where torch and a GPU round to nearest:
    each weight the kernel rounds to bf16 may lie up to one unit of the last place (2^-7 relative) from the
    reference's, which moves the fp32 sum by at most 2^-7 sum_k |x w|; the output's own rounding (truncated
    against rounded to nearest, after sums in another order) adds at most two units of the last place."""
    expected = int4_linear_ref(x, packed, scale, bias).float()
    weight = dequantize(packed, scale, x.shape[-1])
    weights_rounding = 2**-7 * (x.float().abs() @ weight.abs().t())
    bound = 1.01 * weights_rounding + 2 * torch.finfo(torch.bfloat16).eps * expected.abs() + 1e-5
    assert out.dtype == x.dtype and out.shape == expected.shape
    assert ((out.float() - expected).abs() <= bound).all()


def test_triton_kernel_reads_strided_rows(triton_on_cpu) -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 100, generator=g)[:, 10:74]
    packed, scale = quantize_weight_int4(torch.randn(20, 64, generator=g))
    assert_matches_reference(int4_linear(x, packed, scale), x, packed, scale, None)


def test_triton_kernel_takes_strided_weights_and_bias(triton_on_cpu) -> None:
    """Columns of the packed weight, the scale and the bias that are not contiguous are copied into the kernel's
    layout (they were read as if contiguous: wrong numbers, no error)."""
    g = torch.Generator().manual_seed(4)
    packed, scale = quantize_weight_int4(torch.randn(20, 64, generator=g))
    wide = torch.zeros(20, 64, dtype=torch.uint8)
    wide[:, ::2] = packed
    strided_scale = torch.zeros(20, 4, dtype=torch.float16)
    strided_scale[:, ::2] = scale
    bias = torch.randn(20, 2, generator=g)[:, 0]
    x = torch.randn(3, 64, generator=g)
    out = int4_linear(x, wide[:, ::2], strided_scale[:, ::2], bias)
    assert_matches_reference(out, x, packed, scale, bias.contiguous())


@pytest.mark.parametrize("preset", ["mamba2-tiny", "mingru-tiny"])
def test_quantized_model_with_triton_kernels_matches_cpu_path(triton_on_cpu, monkeypatch, preset: str) -> None:
    """An int4 model runs its linear layers through the Triton kernel when the kernels are forced (the CUDA path)
    and gives the logits of the CPU path: prefill, then a batched decode step."""
    calls = count_calls(monkeypatch, [("rnnserve.kernels.int4_linear.fused", "int4_linear_triton")])
    model, _ = load_model(f"random:{preset}", device="cpu")
    quantize_model(model, "int4")
    g = torch.Generator().manual_seed(2)
    chunks = [torch.randint(0, 256, (n,), generator=g) for n in (3, 19)]
    logits = {}
    for forced in (True, False):
        pool = StatePool(model.state_spec(), 3)
        with torch.inference_mode(), force_triton(forced):
            prefill = model.prefill(PrefillBatch.build(chunks, [2, 0], all_logits=[True, True]), pool.tensors)
            decode = model.decode(DecodeBatch.build([7, 9], [2, 0], [3, 19]), pool.tensors)
        logits[forced] = torch.cat([prefill, decode])
    assert calls["int4_linear_triton"] > 0
    torch.testing.assert_close(logits[True], logits[False], rtol=1e-4, atol=1e-4)
