"""Fused residual add + LayerNorm / RMSNorm == the unfused reference (interpreter, small sizes)."""

from __future__ import annotations

import pytest
import torch

from rnnserve.kernels.add_norm import add_norm
from rnnserve.kernels.add_norm.naive import add_norm_ref

WIDTH = 48  # not a power of two


@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_norm_matches_reference(triton_on_cpu, rms, dtype, with_residual):
    gen = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(2, 5, WIDTH, generator=gen) + 1).to(dtype)
    residual = torch.randn(2, 5, WIDTH, generator=gen).to(dtype) if with_residual else None
    weight = torch.randn(WIDTH, generator=gen).to(dtype)
    bias = None if rms else torch.randn(WIDTH, generator=gen).to(dtype)
    normed, summed = add_norm(x, residual, weight, bias, 1e-5, rms)
    normed_ref, summed_ref = add_norm_ref(x, residual, weight, bias, 1e-5, rms)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 4e-2}
    assert normed.dtype == summed.dtype == dtype and normed.shape == x.shape
    torch.testing.assert_close(summed, summed_ref, **tol)
    torch.testing.assert_close(normed, normed_ref, **tol)


@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize(
    ("x_dtype", "residual_dtype", "weight_dtype"),
    [
        (torch.bfloat16, torch.float32, torch.bfloat16),  # an fp32 residual stream, bf16 activations and norm
        (torch.bfloat16, torch.float32, torch.float32),
        (torch.float32, torch.bfloat16, torch.bfloat16),
    ],
)
@pytest.mark.parametrize("fused", [False, True], ids=["reference", "triton"])
def test_add_norm_with_mixed_dtypes_keeps_the_wider_stream(
    request, rms, x_dtype, residual_dtype, weight_dtype, fused
):
    """The sum is ``residual + x`` exactly as PyTorch adds them (the promoted dtype: an fp32 stream is not
    rounded to bf16), and the norm of that sum, with fp32 statistics, comes back once rounded to ``x``'s dtype;
    the reference and the Triton kernel agree."""
    if fused:
        request.getfixturevalue("triton_on_cpu")
    gen = torch.Generator().manual_seed(1)
    x = (3 * torch.randn(2, 5, WIDTH, generator=gen) + 1).to(x_dtype)
    residual = (50 * torch.randn(2, 5, WIDTH, generator=gen)).to(residual_dtype)
    weight = torch.randn(WIDTH, generator=gen).to(weight_dtype)
    bias = None if rms else torch.randn(WIDTH, generator=gen).to(weight_dtype)
    normed, summed = (add_norm if fused else add_norm_ref)(x, residual, weight, bias, 1e-5, rms)
    assert summed.dtype == torch.float32 and normed.dtype == x_dtype and normed.shape == x.shape
    torch.testing.assert_close(summed, residual + x, rtol=0, atol=0)
    r = summed.double()
    centred = r if rms else r - r.mean(-1, keepdim=True)
    expected = centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + 1e-5) * weight.double()
    if bias is not None:
        expected = expected + bias.double()
    torch.testing.assert_close(normed, expected.to(x_dtype), rtol=1e-2, atol=1e-2)
