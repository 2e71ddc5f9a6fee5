"""The AMX skinny-linear kernel equals F.linear (fp32 accumulation, one bf16 rounding) for 1..32 bf16 rows."""

from __future__ import annotations

import pytest
import torch

from rnnserve.engine.models.layers import matmul_t
from rnnserve.kernels.cpu_extension import cpu_ops
from rnnserve.kernels.skinny_linear import MAX_ROWS, amx_available, skinny_linear, skinny_linear_applies
from rnnserve.kernels.skinny_linear.naive import skinny_linear_ref

needs_amx = pytest.mark.skipif(
    not (cpu_ops() and amx_available()), reason="needs the fused CPU kernels and a CPU with AMX-BF16"
)


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = x.float() @ weight.float().t()
    return (out if bias is None else out + bias.float()).to(x.dtype)


def assert_within_one_rounding(out: torch.Tensor, expected: torch.Tensor) -> None:
    """Summation order may move a result across one bf16 rounding boundary, no further."""
    assert out.dtype == expected.dtype and out.shape == expected.shape
    torch.testing.assert_close(out.float(), expected.float(), rtol=2**-7, atol=1e-5)


@needs_amx
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 32])
@pytest.mark.parametrize(("inputs", "outputs"), [(64, 48), (768, 3072), (48, 1544), (33, 17), (1536, 80), (7, 40)])
@pytest.mark.parametrize("bias_dtype", [None, torch.bfloat16, torch.float32])
def test_matches_linear(rows: int, inputs: int, outputs: int, bias_dtype: torch.dtype | None) -> None:
    g = torch.Generator().manual_seed(rows * 1000 + inputs + outputs)
    x = torch.randn(rows, inputs, generator=g).bfloat16()
    weight = (torch.randn(outputs, inputs, generator=g) / inputs**0.5).bfloat16()
    bias = None if bias_dtype is None else torch.randn(outputs, generator=g).to(bias_dtype)
    assert skinny_linear_applies(x, weight)
    out = skinny_linear(x, weight, bias)
    assert out.is_contiguous()
    assert_within_one_rounding(out, reference(x, weight, bias))


@needs_amx
def test_strided_rows_and_weight_slices() -> None:
    """Row strides wider than K (a split of a projection, a column slice of a weight) are read in place."""
    g = torch.Generator().manual_seed(0)
    wide = torch.randn(9, 200, generator=g).bfloat16()
    x = wide[:, 40:136]
    weight_full = torch.randn(70, 300, generator=g).bfloat16()
    weight = weight_full[:, 100:196]
    assert x.stride(0) == 200 and weight.stride(0) == 300
    assert skinny_linear_applies(x, weight)
    assert_within_one_rounding(skinny_linear(x, weight), reference(x, weight, None))


@needs_amx
def test_matmul_t_routes_bf16_decode_batches_through_the_kernel() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 96, generator=g).bfloat16()
    weight = torch.randn(64, 96, generator=g).bfloat16()
    out = matmul_t(x, weight)
    assert out.is_contiguous()  # the W @ x^T path would return a transposed view
    assert_within_one_rounding(out, reference(x, weight, None))


@needs_amx
def test_the_op_rejects_what_it_cannot_run() -> None:
    weight = torch.zeros(16, 32, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="1 to 32 rows"):
        torch.ops.rnnserve.skinny_linear(torch.zeros(MAX_ROWS + 1, 32, dtype=torch.bfloat16), weight, None)
    with pytest.raises(RuntimeError, match="inputs"):
        torch.ops.rnnserve.skinny_linear(torch.zeros(4, 31, dtype=torch.bfloat16), weight, None)
    with pytest.raises(RuntimeError, match="bf16"):
        torch.ops.rnnserve.skinny_linear(torch.zeros(4, 32), weight.float(), None)


@pytest.mark.parametrize("case", ["fp32", "too many rows", "strided inputs", "needs grad", "3-d"])
def test_other_operands_use_the_reference(case: str) -> None:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 64, generator=g).bfloat16()
    weight = torch.randn(24, 64, generator=g).bfloat16()
    if case == "fp32":
        x, weight = x.float(), weight.float()
    elif case == "too many rows":
        x = torch.randn(MAX_ROWS + 1, 64, generator=g).bfloat16()
    elif case == "strided inputs":
        x = torch.randn(64, 4, generator=g).bfloat16().t()
    elif case == "needs grad":
        weight.requires_grad_(True)
    else:
        x = x[None]
    assert not skinny_linear_applies(x, weight)
    assert torch.equal(skinny_linear(x, weight), skinny_linear_ref(x, weight))
