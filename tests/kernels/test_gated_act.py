"""The fused CPU gated activation, ``act(gate) * up`` or ``act(gate)`` alone, == the reference's PyTorch ops (tanh
GELU, SiLU, exact GELU), each result rounded to the inputs' dtype; off the kernel the reference runs."""

from __future__ import annotations

import pytest
import torch

from rnnserve.kernels.cpu_extension import cpu_ops
from rnnserve.kernels.gated_act import gated_act
from rnnserve.kernels.gated_act.naive import gated_act_ref
from tests.kernels.kernel_cases import record_op_calls

needs_cpu_ops = pytest.mark.skipif(not cpu_ops(), reason="fused CPU kernels could not be built")


@needs_cpu_ops
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("activation", ["gelu_tanh", "silu", "gelu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.inference_mode()
def test_cpu_op_matches_reference(
    monkeypatch: pytest.MonkeyPatch, activation: str, dtype: torch.dtype, gated: bool
) -> None:
    g = torch.Generator().manual_seed(0)
    # Rows of a wider GEMM output (strided rows), values from tiny to past tanh's saturation; 37 rows: several
    # thread tasks; 300 columns: a vector tail.
    both = (torch.randn(37, 700, generator=g) * torch.logspace(-4, 1.5, 700)).to(dtype)
    gate, up = both[:, :300], (both[:, 350:650] if gated else None)
    calls = record_op_calls(monkeypatch, torch.ops.rnnserve, "gated_act")
    out = gated_act(gate, up, activation)
    expected = gated_act_ref(gate, up, activation)
    assert len(calls) == 1 and out.dtype == dtype and out.is_contiguous()
    if dtype == torch.float32:
        torch.testing.assert_close(out, expected, rtol=2e-6, atol=1e-7)
    else:  # equal but for a value whose fp32 result lies within a few fp32 units of a bf16 rounding boundary
        torch.testing.assert_close(out.float(), expected.float(), rtol=2**-7, atol=0)
        assert (out != expected).float().mean() < 0.002


@needs_cpu_ops
@pytest.mark.parametrize("activation", ["gelu_tanh", "silu", "gelu"])
def test_saturated_and_infinite_gates(activation: str) -> None:
    gate = torch.tensor([[float("inf"), float("-inf"), 0.0, -30.0, 30.0, -9.5, 9.5]])
    up = torch.full_like(gate, 2.0)
    expected = gated_act_ref(gate, up, activation)
    torch.testing.assert_close(gated_act(gate, up, activation), expected, rtol=1e-6, atol=0, equal_nan=True)


def test_other_layouts_and_names() -> None:
    gate, up = torch.randn(3, 8, 2)[:, :, 0], torch.randn(3, 8)
    assert torch.equal(gated_act(gate, up, "silu"), gated_act_ref(gate, up, "silu"))  # a strided last dim
    with pytest.raises(ValueError, match="activation must be one of"):
        gated_act(up, up, "relu")
