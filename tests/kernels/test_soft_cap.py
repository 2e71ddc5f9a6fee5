"""Logit soft-capping in place: the CPU kernel equals ``cap * tanh(x / cap)`` to a few fp32 units of the last place
(relative) from tiny to saturated logits, in both layouts an LM head returns, and caps infinities at ``±cap``;
elsewhere the reference runs."""

from __future__ import annotations

import pytest
import torch

from rnnserve.kernels.cpu_extension import cpu_ops
from rnnserve.kernels.soft_cap import soft_cap_
from rnnserve.kernels.soft_cap.naive import soft_cap_ref

pytestmark = pytest.mark.skipif(not cpu_ops(), reason="fused CPU kernels could not be built")


@pytest.mark.parametrize("scale", [1e-5, 1e-2, 1.0, 40.0, 1e4])
@pytest.mark.parametrize("layout", ["rows", "columns"])
def test_matches_the_reference(scale: float, layout: str) -> None:
    g = torch.Generator().manual_seed(int(scale * 1000) % 997)
    logits = torch.randn(5, 70001, generator=g) * scale
    if layout == "columns":  # as `W @ x^T` returns them: [R, V] with unit stride along R
        logits = (torch.randn(70001, 5, generator=g) * scale).t()
    expected = soft_cap_ref(logits.double(), 30.0)
    out = soft_cap_(logits, 30.0)
    assert out.data_ptr() == logits.data_ptr()  # in place
    relative = (out.double() - expected).abs() / expected.abs().clamp_min(1e-30)
    assert relative.max().item() < 1e-6


def test_infinities_and_zero() -> None:
    logits = torch.tensor([[float("inf"), float("-inf"), 0.0, -0.0, 1e30]])
    assert soft_cap_(logits, 50.0).tolist() == [[50.0, -50.0, 0.0, -0.0, 50.0]]


def test_other_dtypes_and_layouts_run_the_reference() -> None:
    for logits in (torch.randn(3, 40).bfloat16(), torch.randn(3, 40, 2)[:, :, 0]):
        expected = soft_cap_ref(logits.clone(), 30.0)
        assert torch.equal(soft_cap_(logits, 30.0), expected)
