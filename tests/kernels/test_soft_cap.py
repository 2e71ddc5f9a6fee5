"""Logit soft-capping: the CPU kernel (in place) and the Triton kernel (the LM head's output in its dtype to fp32
logits, under the interpreter) equal ``cap * tanh(x / cap)`` to a few fp32 units of the last place (relative)
from tiny to saturated logits, in both layouts an LM head returns, and cap infinities at ``±cap``; elsewhere the
reference runs."""

from __future__ import annotations

import pytest
import torch

from rnnserve.kernels.cpu_extension import cpu_ops
from rnnserve.kernels.soft_cap import soft_cap, soft_cap_
from rnnserve.kernels.soft_cap.naive import soft_cap_ref

needs_cpu_ops = pytest.mark.skipif(not cpu_ops(), reason="fused CPU kernels could not be built")
SCALES = [1e-5, 1e-2, 1.0, 40.0, 1e4]


def logits_of(scale: float, layout: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(int(scale * 1000) % 997)
    if layout == "columns":  # as `W @ x^T` returns them: [R, V] with unit stride along R
        return (torch.randn(70001, 5, generator=g) * scale).to(dtype).t()
    return (torch.randn(5, 70001, generator=g) * scale).to(dtype)


def assert_close_relative(out: torch.Tensor, expected: torch.Tensor) -> None:
    relative = (out.double() - expected).abs() / expected.abs().clamp_min(1e-30)
    assert relative.max().item() < 1e-6


@needs_cpu_ops
@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("layout", ["rows", "columns"])
def test_matches_the_reference(scale: float, layout: str) -> None:
    logits = logits_of(scale, layout)
    expected = soft_cap_ref(logits.double(), 30.0)
    out = soft_cap_(logits, 30.0)
    assert out.data_ptr() == logits.data_ptr()  # in place
    assert_close_relative(out, expected)


@needs_cpu_ops
def test_infinities_and_zero() -> None:
    logits = torch.tensor([[float("inf"), float("-inf"), 0.0, -0.0, 1e30]])
    assert soft_cap_(logits, 50.0).tolist() == [[50.0, -50.0, 0.0, -0.0, 50.0]]


@needs_cpu_ops
@pytest.mark.parametrize("layout", ["rows", "columns"])
def test_non_finite_logits_as_the_reference(layout: str) -> None:
    """NaN (either sign bit) stays NaN, as ``tanh(NaN)`` is, and infinities become ``±cap``, among finite logits
    of every size, in the vectorised body and the tail of each thread's range."""
    logits = logits_of(40.0, layout)
    special = torch.tensor([float("nan"), -float("nan"), float("inf"), -float("inf")])
    positions = torch.arange(0, logits.numel(), 997)
    flat = logits.t() if layout == "columns" else logits  # memory order
    flat.reshape(-1)[positions] = special.repeat(len(positions) // 4 + 1)[: len(positions)]
    expected = soft_cap_ref(logits.double(), 30.0)
    out = soft_cap_(logits, 30.0)
    assert torch.equal(out.isnan(), expected.isnan()) and out.isnan().sum() > 0
    finite = ~expected.isnan()
    assert_close_relative(out[finite], expected[finite])


def test_other_dtypes_and_layouts_run_the_reference() -> None:
    for logits in (torch.randn(3, 40).bfloat16(), torch.randn(3, 40, 2)[:, :, 0]):
        expected = soft_cap_ref(logits.clone(), 30.0)
        assert torch.equal(soft_cap_(logits, 30.0), expected)


def test_soft_cap_of_bf16_logits_off_triton_is_fp32() -> None:
    logits = torch.randn(3, 40).bfloat16()
    out = soft_cap(logits, 30.0)
    assert out.dtype == torch.float32 and logits.dtype == torch.bfloat16
    torch.testing.assert_close(out, soft_cap_ref(logits.float(), 30.0), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("layout", ["rows", "columns"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_triton_kernel_matches_the_reference(triton_on_cpu, scale: float, layout: str, dtype: torch.dtype) -> None:
    logits = logits_of(scale, layout, dtype)
    before = logits.clone()
    out = soft_cap(logits, 30.0)
    assert out.dtype == torch.float32 and out.stride() == logits.stride() and torch.equal(logits, before)
    assert_close_relative(out, soft_cap_ref(logits.double(), 30.0))


def test_triton_kernel_caps_infinities(triton_on_cpu) -> None:
    logits = torch.tensor([[float("inf"), float("-inf"), 0.0, -0.0, 1e30, float("nan")]])
    out = soft_cap(logits, 50.0)
    assert out[0, :5].tolist() == [50.0, -50.0, 0.0, -0.0, 50.0] and out[0, 5].isnan()
    assert out.data_ptr() != logits.data_ptr()
