"""The interpreter's ``tl.dot`` on bf16 operands: wrong in Triton 3.9 (the bit patterns multiplied as integers),
and as a GPU computes it (operands widened exactly, fp32 accumulation) under ``gpu_bf16_dot``, the patch the
kernel tests run with."""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from tests.kernels.interpreter_dot import gpu_bf16_dot  # noqa: E402

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")


@triton.jit
def _dot_kernel(a_ptr, b_ptr, acc_ptr, out_ptr, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr,
                B_TRANSPOSED: tl.constexpr):
    """``out = acc + a @ b`` for one tile (``b`` given as ``[N, K]`` when ``B_TRANSPOSED``)."""
    rows, cols, ks = tl.arange(0, M), tl.arange(0, N), tl.arange(0, K)
    a = tl.load(a_ptr + rows[:, None] * K + ks[None, :])
    if B_TRANSPOSED:
        b = tl.trans(tl.load(b_ptr + cols[:, None] * K + ks[None, :]))
    else:
        b = tl.load(b_ptr + ks[:, None] * N + cols[None, :])
    acc = tl.load(acc_ptr + rows[:, None] * N + cols[None, :])
    tl.store(out_ptr + rows[:, None] * N + cols[None, :], tl.dot(a, b, acc))


def _interpreted_dot(a: torch.Tensor, b: torch.Tensor, acc: torch.Tensor, b_transposed: bool = False) -> torch.Tensor:
    out = torch.empty_like(acc)
    _dot_kernel[(1,)](a, b.contiguous(), acc, out, a.shape[0], acc.shape[1], a.shape[1], b_transposed)
    return out


def _operands(m: int, n: int, k: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g).to(dtype), torch.randn(k, n, generator=g).to(dtype), torch.randn(m, n)


def _bit_patterns(x: torch.Tensor) -> torch.Tensor:
    """bf16 values' bit patterns as the integers they are (float64 holds their products and sums exactly)."""
    return x.view(torch.int16).to(torch.float64).remainder(2**16)


def test_unpatched_interpreter_multiplies_bf16_bit_patterns() -> None:
    """The bug the patch is for. If a Triton upgrade fixed it, this says so: the patch can then go."""
    a, b, acc = _operands(16, 16, 32, torch.bfloat16)
    out = _interpreted_dot(a, b, acc)
    if torch.allclose(out, torch.addmm(acc, a.float(), b.float()), rtol=1e-5, atol=1e-5):
        pytest.fail(f"Triton {triton.__version__}'s interpreter computes bf16 tl.dot correctly now: drop "
                    "tests/kernels/interpreter_dot.py (gpu_bf16_dot), this test and the note in docs/kernels.md")
    bits = (acc.double() + _bit_patterns(a) @ _bit_patterns(b)).float()
    torch.testing.assert_close(out, bits, rtol=1e-6, atol=0,
                               msg="the interpreter's bf16 tl.dot is wrong in a way other than the known one")


def _assert_within_fp32_summation_error(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, acc: torch.Tensor,
                                        expected: torch.Tensor) -> None:
    """``out`` and ``expected`` both within ``(K + 1)`` fp32 roundings of ``acc + a @ b`` summed exactly (float64),
    relative to the sum of the terms' magnitudes: the bound of any fp32 summation order."""
    exact = acc.double() + a.double() @ b.double()
    bound = (a.shape[1] + 1) * 2.0**-24 * (acc.double().abs() + a.double().abs() @ b.double().abs())
    for result in (out, expected):
        assert ((result.double() - exact).abs() <= bound).all()


@pytest.mark.parametrize(("m", "n", "k"), [(16, 16, 16), (32, 16, 64), (16, 64, 32)])
@pytest.mark.parametrize("b_transposed", [False, True])
def test_patched_dot_equals_bf16_matmul_accumulated_in_fp32(m: int, n: int, k: int, b_transposed: bool) -> None:
    """``acc + a @ b`` of bf16 operands == torch's matmul of the operands widened to fp32 into an fp32 accumulator,
    up to the fp32 summation order (the unpatched dot is ~1e10 off)."""
    a, b, acc = _operands(m, n, k, torch.bfloat16, seed=m + n + k)
    with gpu_bf16_dot():
        out = _interpreted_dot(a, b.t() if b_transposed else b, acc, b_transposed)
    expected = torch.addmm(acc, a.float(), b.float())
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    _assert_within_fp32_summation_error(out, a, b, acc, expected)


def test_patched_dot_is_exact_where_fp32_sums_are() -> None:
    """Operands of small multiples of 1/8, and in row 0 of ``a`` / column 0 of ``b`` a huge, a tiny and a
    subnormal bf16 value whose products are 1 and 2^-10: every product and partial sum is exact in fp32, so the
    patched dot equals the exact result bit for bit (a dot that accumulated in bf16 would not)."""
    g = torch.Generator().manual_seed(3)
    a = (torch.randint(-64, 64, (16, 32), generator=g) / 8).bfloat16()
    b = (torch.randint(-64, 64, (32, 16), generator=g) / 8).bfloat16()
    a[:, :2], b[:2] = 0.0, 0.0
    a[0, :2] = torch.tensor([2.0**100, 2.0**-130])  # 2^-130: a bf16 (and fp32) subnormal
    b[:2, 0] = torch.tensor([2.0**-100, 2.0**120])
    acc = torch.randint(-1000, 1000, (16, 16), generator=g).float()
    with gpu_bf16_dot():
        out = _interpreted_dot(a, b, acc)
    exact = acc.double() + a.double() @ b.double()
    assert torch.equal(out.double(), exact)
    assert exact[0, 0] != exact[0, 0].float().bfloat16().double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_other_dots_are_the_interpreters(dtype: torch.dtype) -> None:
    a, b, acc = _operands(16, 16, 32, dtype, seed=4)
    unpatched = _interpreted_dot(a, b, acc)
    with gpu_bf16_dot():
        assert torch.equal(_interpreted_dot(a, b, acc), unpatched)
    torch.testing.assert_close(unpatched, torch.addmm(acc, a.float(), b.float()), rtol=1e-5, atol=1e-5)


def test_kernel_fixture_applies_the_patch(triton_on_cpu) -> None:
    """Kernel tests that take ``triton_on_cpu`` run with the patch; it is gone after the context."""
    a, b, acc = _operands(16, 16, 16, torch.bfloat16, seed=5)
    torch.testing.assert_close(_interpreted_dot(a, b, acc), torch.addmm(acc, a.float(), b.float()),
                               rtol=1e-6, atol=1e-6)
