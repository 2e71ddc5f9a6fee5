"""Mamba's residual add + RMSNorm: the fused CPU kernel and the Triton kernel equal the reference, whose
rounding steps are the Hugging Face blocks' (fp32 residual stream, the norm's input rounded to the weight dtype)."""

from __future__ import annotations

import pytest
import torch

from rnnserve.kernels.cpu_extension import cpu_ops
from rnnserve.kernels.residual_rms_norm import residual_rms_norm
from rnnserve.kernels.residual_rms_norm.naive import residual_rms_norm_ref

bf16 = torch.bfloat16
DTYPES = [(torch.float32, torch.float32), (torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16)]


def inputs(stream_dtype: torch.dtype, weight_dtype: torch.dtype, with_delta: bool, transposed_delta: bool):
    g = torch.Generator().manual_seed(0)
    stream = (torch.randn(37, 300, generator=g) * 3).to(stream_dtype)
    delta = None
    if with_delta:
        delta = torch.randn(300, 37, generator=g).t() if transposed_delta else torch.randn(37, 300, generator=g)
        delta = delta.to(weight_dtype)
    weight = (torch.rand(300, generator=g) + 0.5).to(weight_dtype)
    return stream, delta, weight


@pytest.mark.skipif(not cpu_ops(), reason="fused CPU kernels could not be built")
@pytest.mark.parametrize(("stream_dtype", "weight_dtype"), DTYPES)
@pytest.mark.parametrize(("with_delta", "transposed_delta"), [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("round_to_weight_dtype", [True, False])
def test_fused_kernel_matches_reference(
    stream_dtype: torch.dtype,
    weight_dtype: torch.dtype,
    with_delta: bool,
    transposed_delta: bool,
    round_to_weight_dtype: bool,
) -> None:
    stream, delta, weight = inputs(stream_dtype, weight_dtype, with_delta, transposed_delta)
    normed, new_stream = residual_rms_norm(stream, delta, weight, 1e-5, round_to_weight_dtype)
    normed_ref, stream_ref = residual_rms_norm_ref(stream, delta, weight, 1e-5, round_to_weight_dtype)
    assert_matches_reference(normed, new_stream, normed_ref, stream_ref, weight_dtype, stream_dtype)


@pytest.mark.parametrize(("stream_dtype", "weight_dtype"), DTYPES)
@pytest.mark.parametrize(("with_delta", "transposed_delta"), [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("round_to_weight_dtype", [True, False])
def test_triton_kernel_matches_reference(
    triton_on_cpu: None,
    stream_dtype: torch.dtype,
    weight_dtype: torch.dtype,
    with_delta: bool,
    transposed_delta: bool,
    round_to_weight_dtype: bool,
) -> None:
    stream, delta, weight = inputs(stream_dtype, weight_dtype, with_delta, transposed_delta)
    normed, new_stream = residual_rms_norm(stream, delta, weight, 1e-5, round_to_weight_dtype)
    normed_ref, stream_ref = residual_rms_norm_ref(stream, delta, weight, 1e-5, round_to_weight_dtype)
    assert normed.dtype == weight_dtype and new_stream.dtype == stream_dtype
    if delta is None:
        assert new_stream is stream
    # Triton 3.9's interpreter truncates fp32 -> bf16 casts where a GPU rounds to nearest even (which
    # tests/gpu/test_kernels_gpu.py checks bit for bit): here each bf16 rounding may be off by one ulp.
    ulps = 2**-7 if bf16 in (stream_dtype, weight_dtype) else 1e-6
    torch.testing.assert_close(new_stream, stream_ref, rtol=ulps, atol=0)
    torch.testing.assert_close(normed, normed_ref, rtol=3 * ulps, atol=1e-6)


def test_triton_kernel_on_a_three_dimensional_stream(triton_on_cpu: None) -> None:
    stream, delta = (t.view(37, 3, 100) for t in inputs(torch.float32, torch.float32, True, False)[:2])
    weight = torch.rand(100) + 0.5
    normed, new_stream = residual_rms_norm(stream, delta, weight, 1e-5)
    normed_ref, stream_ref = residual_rms_norm_ref(stream, delta, weight, 1e-5)
    assert normed.shape == new_stream.shape == (37, 3, 100)
    assert_matches_reference(normed, new_stream, normed_ref, stream_ref, torch.float32, torch.float32)


def assert_matches_reference(
    normed: torch.Tensor,
    new_stream: torch.Tensor,
    normed_ref: torch.Tensor,
    stream_ref: torch.Tensor,
    weight_dtype: torch.dtype,
    stream_dtype: torch.dtype,
) -> None:
    assert normed.dtype == weight_dtype and new_stream.dtype == stream_dtype
    assert torch.equal(new_stream, stream_ref)
    # The sum of squares runs in another order than torch's: the scale may move by an ulp, which moves an
    # fp32 result by an ulp or two and, rarely, a bf16 result across one rounding boundary.
    if weight_dtype == torch.bfloat16:
        torch.testing.assert_close(normed, normed_ref, rtol=2**-7, atol=0)
        assert (normed != normed_ref).float().mean() < 0.01
    else:
        torch.testing.assert_close(normed, normed_ref, rtol=1e-6, atol=1e-6)


def test_reference_rounds_like_the_hugging_face_block() -> None:
    """fp32 stream, bf16 weights: the stream stays fp32; a block norm sees it rounded to bf16, the final
    norm does not (its product with the weight is fp32, rounded once)."""
    stream, delta, weight = inputs(torch.float32, torch.bfloat16, True, False)
    summed = stream + delta.float()
    block, new_stream = residual_rms_norm_ref(stream, delta, weight, 1e-5, True)
    final, _ = residual_rms_norm_ref(stream, delta, weight, 1e-5, False)
    assert new_stream.dtype == torch.float32 and torch.equal(new_stream, summed)
    rounded = summed.bfloat16().float()
    expected_block = weight * (rounded * torch.rsqrt(rounded.pow(2).mean(-1, keepdim=True) + 1e-5)).bfloat16()
    expected_final = (weight * (summed * torch.rsqrt(summed.pow(2).mean(-1, keepdim=True) + 1e-5))).bfloat16()
    assert torch.equal(block, expected_block) and torch.equal(final, expected_final)
    assert not torch.equal(block, final)


@pytest.mark.skipif(not cpu_ops(), reason="fused CPU kernels could not be built")
def test_fused_kernel_rounds_bf16_sums_as_torch() -> None:
    """The kernel's own bf16 rounding: ties to even both ways, a sum past bf16's largest finite value, inf and NaN."""
    stream = torch.tensor([[1.0, 1.0078125, -1.0, 3.0e38, float("inf"), float("nan"), 0.5, 2.0]], dtype=bf16)
    delta = torch.tensor([[2**-8, 2**-8, -(2**-8), 3.0e38, 1.0, 1.0, 2**-10, -(2**-8)]], dtype=bf16)
    weight = torch.ones(8, dtype=bf16)
    _, new_stream = residual_rms_norm(stream, delta, weight, 1e-5, True)
    expected = (stream.float() + delta.float()).bfloat16()
    assert torch.equal(new_stream[:, :5], expected[:, :5]) and torch.equal(new_stream[:, 6:], expected[:, 6:])
    assert new_stream[0, :4].tolist() == [1.0, 1.015625, -1.0, float("inf")] and new_stream[0, 5].isnan()
