"""Mamba-2's gated group RMSNorm: the Triton kernel and the C++ kernel equal the reference, whose rounding steps
are the model's op-by-op norm (fp32 gating and statistics, the normalised value rounded to z's dtype, then times
the weight)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rnnserve.kernels import gated_rms_norm as gated_rms_norm_module
from rnnserve.kernels.cpu_extension import cpu_ops
from rnnserve.kernels.gated_rms_norm import gated_rms_norm
from rnnserve.kernels.gated_rms_norm.naive import gated_rms_norm_ref
from tests.kernels.kernel_cases import record_op_calls

f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
# (y, z, weight) dtypes: SSD output fp32 or in the activation dtype, a weight of z's dtype or an fp32 one.
DTYPES = [(f32, f32, f32), (f32, bf16, bf16), (bf16, bf16, bf16), (f16, f16, f16), (f32, bf16, f32)]
# Widths per group that are not powers of two mask the tail of the block; 2048 is mamba2-370m's d_inner.
SHAPES = [(1, 300), (3, 111), (1, 2048)]


def inputs(y_dtype: torch.dtype, z_dtype: torch.dtype, w_dtype: torch.dtype, groups: int, dim: int, rows: int = 9):
    """``z`` is a column slice of a wider projection (row stride > its width), as the mixer passes it."""
    g = torch.Generator().manual_seed(groups * dim)
    projected = (torch.randn(rows, 2 * dim + 19, generator=g) * 2).to(z_dtype)
    y = torch.randn(rows, dim, generator=g).to(y_dtype)
    weight = (torch.rand(dim, generator=g) + 0.5).to(w_dtype)
    return y, projected[:, dim + 19 :], weight


@pytest.mark.parametrize(("groups", "dim"), SHAPES)
@pytest.mark.parametrize(("y_dtype", "z_dtype", "w_dtype"), DTYPES)
def test_triton_kernel_matches_reference(
    triton_on_cpu: None, y_dtype: torch.dtype, z_dtype: torch.dtype, w_dtype: torch.dtype, groups: int, dim: int
) -> None:
    y, z, weight = inputs(y_dtype, z_dtype, w_dtype, groups, dim)
    assert z.stride(0) > dim
    out = gated_rms_norm(y, z, weight, groups, 1e-5)
    ref = gated_rms_norm_ref(y, z, weight, groups, 1e-5)
    assert out.dtype == ref.dtype == torch.promote_types(w_dtype, z_dtype) and out.shape == ref.shape
    # The interpreter's exp and sum order differ from torch's: silu and the scale move by an ulp or so, which
    # moves an fp32 result by a few ulps and, rarely, an fp16 one across a rounding boundary. Its fp32 -> bf16
    # casts truncate (a GPU rounds to nearest even), so each of a bf16 result's two roundings may be off by an
    # ulp; test_bf16_rounding_points checks them bit for bit.
    if z_dtype == bf16:
        torch.testing.assert_close(out, ref, rtol=2**-6, atol=0)
    elif z_dtype == f16:
        torch.testing.assert_close(out, ref, rtol=2**-10, atol=0)
        assert (out != ref).float().mean() < 0.005
    else:
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)


def _truncate_to_bf16(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16 -> fp32 as the interpreter casts: the low 16 bits dropped."""
    return (x.float().view(torch.int32) & -65536).view(torch.float32)


@pytest.mark.parametrize("y_dtype", [f32, bf16])
@pytest.mark.parametrize(("groups", "dim"), SHAPES[:2])
def test_bf16_rounding_points(triton_on_cpu: None, y_dtype: torch.dtype, groups: int, dim: int) -> None:
    """The kernel rounds where the reference does: the normalised value, then its product with the weight."""
    y, z, weight = inputs(y_dtype, bf16, bf16, groups, dim)
    out = gated_rms_norm(y, z, weight, groups, 1e-5)
    gated = (y.float() * F.silu(z.float())).unflatten(-1, (groups, -1))
    normed = _truncate_to_bf16(gated * torch.rsqrt(gated.pow(2).mean(-1, keepdim=True) + 1e-5)).flatten(-2)
    assert torch.equal(out.float(), _truncate_to_bf16(weight.float() * normed))


def test_triton_kernel_on_three_dimensional_inputs(triton_on_cpu: None) -> None:
    y, z, weight = inputs(f32, f32, f32, 2, 64, rows=12)
    y3, z3 = y.view(3, 4, 64), z.unflatten(0, (3, 4))
    out = gated_rms_norm(y3, z3, weight, 2, 1e-5)
    assert out.shape == (3, 4, 64)
    torch.testing.assert_close(out, gated_rms_norm_ref(y3, z3, weight, 2, 1e-5), rtol=1e-6, atol=1e-6)


@pytest.mark.skipif(not cpu_ops(), reason="fused CPU kernels could not be built")
@pytest.mark.parametrize(("groups", "dim"), SHAPES)
@pytest.mark.parametrize("dtype", [f32, bf16])
@torch.inference_mode()
def test_cpu_kernel_matches_reference(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, groups: int, dim: int
) -> None:
    """fp32 y (the SSD's output), z a column slice in the activation dtype, the weight in z's dtype."""
    y, z, weight = inputs(f32, dtype, dtype, groups, dim)
    calls = record_op_calls(monkeypatch, torch.ops.rnnserve, "gated_rms_norm")
    out = gated_rms_norm(y, z, weight, groups, 1e-5)
    ref = gated_rms_norm_ref(y, z, weight, groups, 1e-5)
    assert len(calls) == 1 and out.dtype == ref.dtype == dtype and out.is_contiguous()
    if dtype == bf16:  # its SiLU and sums are not torch's: rarely a value crosses a bf16 rounding boundary
        torch.testing.assert_close(out, ref, rtol=2**-7, atol=0)
        assert (out != ref).float().mean() < 0.01
    else:
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)


def test_reference_off_gpu_is_the_op_by_op_norm(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without Triton or the C++ kernel the public function is the reference: weight * normalised value rounded to
    z's dtype."""
    monkeypatch.setattr(gated_rms_norm_module, "use_cpu_kernel", lambda x: False)
    y, z, weight = inputs(f32, bf16, bf16, 2, 64)
    gated = (y * F.silu(z.float())).view(-1, 2, 32)
    normed = (gated * torch.rsqrt(gated.pow(2).mean(-1, keepdim=True) + 1e-5)).view(-1, 64).bfloat16()
    assert torch.equal(gated_rms_norm(y, z, weight, 2, 1e-5), weight * normed)
