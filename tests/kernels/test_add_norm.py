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
