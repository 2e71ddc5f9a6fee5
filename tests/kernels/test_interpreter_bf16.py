"""The interpreter's ``tl.dot`` on bf16 operands and integer -> bf16 casts: wrong in Triton 3.9 (bit patterns
multiplied as integers; integers stored as bit patterns), and as a GPU computes them under the patches the kernel
tests run with (``tests/kernels/interpreter_bf16.py``): operands widened exactly with fp32 accumulation, integers
rounded to the nearest bf16."""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from tests.kernels.interpreter_bf16 import gpu_bf16_dot, gpu_integer_to_bf16  # noqa: E402

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
        pytest.fail(f"Triton {triton.__version__}'s interpreter computes bf16 tl.dot correctly now: drop gpu_bf16_dot "
                    "from tests/kernels/interpreter_bf16.py, this test and the note in docs/kernels.md")
    bits = (acc.double() + _bit_patterns(a) @ _bit_patterns(b)).float()
    torch.testing.assert_close(out, bits, rtol=1e-5, atol=0,
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


@triton.jit
def _to_bf16_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    """``dst = src.to(bf16)`` for ``n`` values (stored as they are: no other cast on the way)."""
    offsets = tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(dst_ptr + offsets, tl.load(src_ptr + offsets, mask=mask).to(tl.bfloat16), mask=mask)


def _interpreted_bf16_cast(integers: torch.Tensor) -> torch.Tensor:
    out = torch.empty(integers.numel(), dtype=torch.bfloat16)
    _to_bf16_kernel[(1,)](integers, out, integers.numel(), triton.next_power_of_2(integers.numel()))
    return out


def test_unpatched_interpreter_keeps_integers_as_bf16_bit_patterns() -> None:
    """The bug the cast patch is for (int8_linear converts its int8 weights to bf16 for tl.dot): -3 becomes 0xFFFD
    (a NaN), 1 becomes 0x0001 (2^-133). If a Triton upgrade fixed it, this says so."""
    integers = torch.arange(-128, 128, dtype=torch.int8)
    out = _interpreted_bf16_cast(integers)
    if torch.equal(out, integers.bfloat16()):
        pytest.fail(f"Triton {triton.__version__}'s interpreter casts integers to bf16 correctly now: drop "
                    "gpu_integer_to_bf16 from tests/kernels/interpreter_bf16.py, this test and the note in "
                    "docs/kernels.md")
    assert torch.equal(out.view(torch.int16), integers.to(torch.int16)), (
        "the interpreter's integer -> bf16 cast is wrong in a way other than the known one")


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.int16, torch.int32])
def test_patched_integer_casts_round_to_the_nearest_bf16(dtype: torch.dtype) -> None:
    """Every int8 / uint8 value (exact in bf16), and wider integers that bf16 rounds, ties to even among them
    (257 -> 256, 259 -> 260, -385 -> -384), equal torch's conversion."""
    info = torch.iinfo(dtype)
    integers = torch.arange(max(info.min, -128), min(info.max, 255) + 1)
    if info.bits > 8:
        ties = torch.tensor([257, 259, 383, 385, -385, -(2**14) - 64, 2**14 + 192, info.max, info.min])
        # Within 2^24, where torch's conversion (through fp32) rounds once.
        wide = torch.randint(max(info.min, -(2**24)), min(info.max, 2**24), (200,),
                             generator=torch.Generator().manual_seed(6))
        integers = torch.cat([integers, ties, wide])
    integers = integers.to(dtype)
    with gpu_integer_to_bf16():
        out = _interpreted_bf16_cast(integers)
    assert torch.equal(out, integers.bfloat16())


def test_kernel_fixture_applies_the_patch(triton_on_cpu) -> None:
    """Kernel tests that take ``triton_on_cpu`` run with both patches."""
    a, b, acc = _operands(16, 16, 16, torch.bfloat16, seed=5)
    torch.testing.assert_close(_interpreted_dot(a, b, acc), torch.addmm(acc, a.float(), b.float()),
                               rtol=1e-5, atol=1e-5)
    integers = torch.arange(-128, 128, dtype=torch.int8)
    assert torch.equal(_interpreted_bf16_cast(integers), integers.bfloat16())
