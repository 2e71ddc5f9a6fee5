"""The GEMV / skinny-GEMM kernel equals fp32 math on its operands (fp32: to rounding noise; bf16: within one
bf16 rounding), for every row count it takes and for shapes that leave vector remainders; the linear layers
and the fused Mamba step route through it, and ``ENABLED`` switches it off at call time."""

from __future__ import annotations

import platform

import pytest
import torch
import torch.nn.functional as F

from rnnserve.engine.models.layers import matmul_t
from rnnserve.engine.models.layers.linear import onednn_rows
from rnnserve.kernels import gemv as gemv_module
from rnnserve.kernels.cpu_extension import cpu_ops
from rnnserve.kernels.gemv import ROW_LIMITS, gemv, gemv_applies, row_limit
from rnnserve.kernels.gemv.naive import gemv_ref
from rnnserve.kernels.mamba_decode import mamba_mixer_decode
from rnnserve.kernels.mamba_decode.naive import mamba_mixer_decode_ref
from rnnserve.kernels.skinny_linear import skinny_linear_applies
from tests.kernels.kernel_cases import record_op_calls

pytestmark = pytest.mark.skipif(not cpu_ops(), reason="fused CPU kernels could not be built")

OP_MAX_ROWS = 64


def operands(rows: int, inputs: int, outputs: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, inputs, generator=g).to(dtype)
    weight = (torch.randn(outputs, inputs, generator=g) / max(inputs, 1) ** 0.5).to(dtype)
    return x, weight


def assert_matches(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """fp32: the reference up to summation order; bf16: the fp32 result on the bf16 values, rounded once (a
    different summation order may cross one rounding boundary, no more)."""
    expected = gemv_ref(x, weight, bias)
    assert out.dtype == expected.dtype and out.shape == expected.shape and out.is_contiguous()
    if x.dtype == torch.float32:
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(out.float(), expected.float(), rtol=2**-7, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 17, 32, OP_MAX_ROWS])
@pytest.mark.parametrize(
    ("inputs", "outputs"), [(768, 3072), (48, 1544), (33, 17), (1536, 80), (3072, 24), (8200, 3), (7, 40), (1, 5)]
)
def test_op_matches_reference(dtype: torch.dtype, rows: int, inputs: int, outputs: int) -> None:
    x, weight = operands(rows, inputs, outputs, dtype, seed=rows * 1000 + inputs + outputs)
    assert_matches(torch.ops.rnnserve.gemv(x, weight, None), x, weight, None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias_dtype", [torch.float32, torch.bfloat16])
def test_bias(dtype: torch.dtype, bias_dtype: torch.dtype) -> None:
    x, weight = operands(3, 100, 70, dtype, seed=4)
    bias = torch.randn(70, generator=torch.Generator().manual_seed(5)).to(bias_dtype)
    assert_matches(torch.ops.rnnserve.gemv(x, weight, bias), x, weight, bias)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 8, 9, 24, OP_MAX_ROWS])  # one row of W at a time, and the 3-row blocks
@pytest.mark.parametrize("with_bias", [False, True])
def test_widened_op_is_the_op_then_float(dtype: torch.dtype, rows: int, with_bias: bool) -> None:
    """``gemv_widened`` writes fp32 the values ``gemv`` would have rounded to x's dtype: bit for bit its
    ``.float()``."""
    x, weight = operands(rows, 200, 1000, dtype, seed=rows)
    bias = torch.randn(1000, generator=torch.Generator().manual_seed(7)) if with_bias else None
    widened = torch.ops.rnnserve.gemv_widened(x, weight, bias)
    assert widened.dtype == torch.float32 and widened.is_contiguous()
    assert torch.equal(widened, torch.ops.rnnserve.gemv(x, weight, bias).float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [3, OP_MAX_ROWS + 1])
def test_matmul_t_widened_takes_the_kernels_bf16_products_to_fp32(
    dtype: torch.dtype, rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An LM head's product comes fp32 from the kernel where it takes a bf16 product (its values those of
    ``matmul_t``), and is ``matmul_t``'s own result everywhere else."""
    x, weight = operands(rows, 64, 300, dtype, seed=rows)
    calls = record_op_calls(monkeypatch, torch.ops.rnnserve, "gemv_widened")
    logits = matmul_t(x, weight, widened=True)
    widened = dtype == torch.bfloat16 and gemv_applies(x, weight) and not skinny_linear_applies(x, weight)
    assert len(calls) == int(widened)
    assert logits.dtype == (torch.float32 if widened else dtype)
    assert torch.equal(logits.float(), matmul_t(x, weight).float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_strided_rows_and_weight_slices(dtype: torch.dtype) -> None:
    """Rows of ``x`` wider than K (a split of a projection) and a column slice of a weight are read in place."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 200, generator=g).to(dtype)[:, 40:136]
    weight = torch.randn(70, 300, generator=g).to(dtype)[:, 100:196]
    assert x.stride(0) == 200 and weight.stride(0) == 300
    assert gemv_applies(x, weight)
    assert_matches(gemv(x, weight), x, weight, None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [2, 4, 8, 11, 24, OP_MAX_ROWS])
def test_long_rows_of_w_taken_over_k_in_passes(dtype: torch.dtype, rows: int) -> None:
    """Rows of W too long for a chunk of x to stay in L1 over all of K (8200 inputs: bf16 from 4 rows of x, fp32
    from 8) are summed pass by pass: with a bias, a weight that is a column slice of a wider one, a last pass
    that is not a whole vector, and a count of W's rows that the 3-row blocks do not divide."""
    g = torch.Generator().manual_seed(rows)
    inputs, outputs = 8200, 71
    x = torch.randn(rows, inputs, generator=g).to(dtype)
    weight = (torch.randn(outputs, inputs + 40, generator=g) / inputs**0.5).to(dtype)[:, 24 : 24 + inputs]
    bias = torch.randn(outputs, generator=g)
    assert_matches(torch.ops.rnnserve.gemv(x, weight, bias), x, weight, bias)
    widened = torch.ops.rnnserve.gemv_widened(x, weight, bias)
    assert torch.equal(widened, torch.ops.rnnserve.gemv(x, weight, bias).float())


def test_the_op_rejects_what_it_cannot_run() -> None:
    weight = torch.zeros(16, 32)
    with pytest.raises(RuntimeError, match="1 to 64 rows"):
        torch.ops.rnnserve.gemv(torch.zeros(OP_MAX_ROWS + 1, 32), weight, None)
    with pytest.raises(RuntimeError, match="inputs"):
        torch.ops.rnnserve.gemv(torch.zeros(4, 31), weight, None)
    with pytest.raises(RuntimeError, match="both be fp32 or both bf16"):
        torch.ops.rnnserve.gemv(torch.zeros(4, 32, dtype=torch.bfloat16), weight, None)
    with pytest.raises(RuntimeError, match="unit stride"):
        torch.ops.rnnserve.gemv(torch.zeros(4, 32), torch.zeros(32, 16).t(), None)
    with pytest.raises(RuntimeError, match="bias"):
        torch.ops.rnnserve.gemv(torch.zeros(4, 32), weight, torch.zeros(15))


@pytest.mark.parametrize("case", ["fp16", "mixed dtypes", "too many rows", "strided inputs", "needs grad", "3-d"])
def test_other_operands_use_the_reference(case: str) -> None:
    x, weight = operands(4, 64, 24, torch.float32, seed=2)
    if case == "fp16":
        x, weight = x.half(), weight.half()
    elif case == "mixed dtypes":
        weight = weight.bfloat16()
    elif case == "too many rows":
        x = torch.randn(65, 64)  # the op takes 64 rows at most
    elif case == "strided inputs":
        x = torch.randn(64, 4).t()
    elif case == "needs grad":
        weight.requires_grad_(True)
    else:
        x = x[None]
    assert not gemv_applies(x, weight)
    if case != "mixed dtypes":
        assert torch.equal(gemv(x, weight), gemv_ref(x, weight))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matmul_t_routes_decode_batches_through_the_kernel_and_the_switch_restores_the_old_path(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    x, weight = operands(4, 96, 64, dtype, seed=1)
    if skinny_linear_applies(x, weight):
        pytest.skip("bf16 goes to the AMX kernel on this CPU")
    assert row_limit(dtype) == ROW_LIMITS[dtype] and gemv_applies(x, weight)
    out = matmul_t(x, weight)
    assert out.is_contiguous()  # the W @ x^T path would return a transposed view
    assert_matches(out, x, weight, None)
    monkeypatch.setattr(gemv_module, "ENABLED", False)
    monkeypatch.setattr(gemv_module, "UPCAST_BF16_GEMM", False)
    monkeypatch.setattr(gemv_module, "ONEDNN_FP32_GEMM", False)
    assert row_limit(dtype) == 0 and not gemv_applies(x, weight)
    old = matmul_t(x, weight)
    assert not old.is_contiguous()
    assert_matches(old.contiguous(), x, weight, None)


@pytest.mark.parametrize("rows", [1, 70, 300])
def test_bf16_beyond_the_kernel_runs_in_fp32_where_the_cpu_has_no_bf16_arithmetic(
    rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past the kernel's rows (or with it off), a bf16 product on a CPU without bf16 arithmetic is the fp32 GEMM
    of the upcast operands, rounded once; with the switch cleared, ATen's bf16 GEMM paths as before."""
    x, weight = operands(rows, 96, 200, torch.bfloat16, seed=rows)
    bias = torch.randn(200, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    monkeypatch.setattr(gemv_module, "ENABLED", rows != 1)
    assert not gemv_applies(x, weight)
    monkeypatch.setattr(gemv_module, "UPCAST_BF16_GEMM", True)
    assert_matches(matmul_t(x, weight, bias), x, weight, bias)  # one rounding: the bias is added in fp32
    monkeypatch.setattr(gemv_module, "UPCAST_BF16_GEMM", False)
    assert_matches(matmul_t(x, weight).contiguous(), x, weight, None)  # ATen adds a bias after rounding


def test_the_upcast_follows_the_cpu() -> None:
    native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    assert gemv_module.native_bf16_gemm() == native
    assert gemv_module.UPCAST_BF16_GEMM == (not native)
    avx512 = torch.backends.cpu.get_cpu_capability().startswith("AVX512")  # fp32 blocks measured there only
    fp32 = (24 if gemv_module.ONEDNN_FP32_GEMM else 64) if avx512 else 12
    assert ROW_LIMITS == {torch.float32: fp32, torch.bfloat16: 64}


def test_fp32_weights_with_short_rows_take_the_kernel_to_32_rows_beside_onednn() -> None:
    beside_onednn = gemv_module.AVX512 and gemv_module.ONEDNN_FP32_GEMM
    assert row_limit(torch.float32, 1536) == (32 if beside_onednn else ROW_LIMITS[torch.float32])
    assert row_limit(torch.float32, 1537) == row_limit(torch.float32) == ROW_LIMITS[torch.float32]
    assert row_limit(torch.float32, 1500) == ROW_LIMITS[torch.float32]  # rows of W that are not whole lines
    assert row_limit(torch.bfloat16, 768) == ROW_LIMITS[torch.bfloat16]
    x, weight = operands(30, 768, 16, torch.float32, seed=3)
    assert gemv_applies(x, weight) == beside_onednn
    assert_matches(torch.ops.rnnserve.gemv(x, weight, None), x, weight, None)


def test_onednn_follows_the_build() -> None:
    x86 = platform.machine().lower() in {"x86_64", "amd64"}
    expected = x86 and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    assert gemv_module.onednn_fp32_gemm() == expected == gemv_module.ONEDNN_FP32_GEMM


@pytest.mark.skipif(not gemv_module.ONEDNN_FP32_GEMM, reason="needs PyTorch's oneDNN (x86 builds)")
@pytest.mark.parametrize("rows", [9, 40, 130, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_fp32_beyond_the_kernel_runs_onednn(rows: int, with_bias: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past the kernel's rows an fp32 product is oneDNN's inner product (a contiguous result, unlike the MKL
    paths' ``(W @ x^T)^T``), equal to ATen's up to summation order; clearing the switch restores those paths."""
    x, weight = operands(rows, 96, 200, torch.float32, seed=rows)
    bias = torch.randn(200, generator=torch.Generator().manual_seed(6)) if with_bias else None
    if rows <= row_limit(torch.float32, weight.shape[1]):
        monkeypatch.setattr(gemv_module, "ENABLED", False)
    calls = record_op_calls(monkeypatch, torch.ops.mkldnn, "_linear_pointwise")
    out = matmul_t(x, weight, bias)
    assert len(calls) == 1 and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(gemv_module, "ONEDNN_FP32_GEMM", False)
    old = matmul_t(x, weight, bias)
    assert len(calls) == 1
    torch.testing.assert_close(old, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    with torch.enable_grad():  # no autograd formula: a product that needs a gradient keeps ATen's
        weight.requires_grad_(True)
        assert matmul_t(x, weight, bias).requires_grad and len(calls) == 1


def test_onednn_rows_are_few_per_doubling_and_waste_at_most_an_eighth() -> None:
    """oneDNN builds and caches a primitive per shape: a prefill's every row count was one, so the caches churned
    and the heap grew; bucketed, 2048 row counts are a few dozen shapes."""
    padded = [onednn_rows(rows) for rows in range(1, 4097)]
    assert all(rows <= p <= rows * 1.125 for rows, p in enumerate(padded, start=1))
    assert len(set(padded[:2048])) <= 80
    assert [onednn_rows(rows) for rows in (1, 16, 17, 31, 32, 33, 600, 2048)] == [1, 16, 18, 32, 32, 36, 640, 2048]


@pytest.mark.skipif(not gemv_module.ONEDNN_FP32_GEMM, reason="needs PyTorch's oneDNN (x86 builds)")
@pytest.mark.parametrize("rows", [33, 100, 601])
def test_onednn_multiplies_bucketed_rows(rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The rows oneDNN gets are padded with zeros to ``onednn_rows``; the result has the rows asked for,
    contiguous, as ATen's."""
    x, weight = operands(rows, 96, 200, torch.float32, seed=rows)
    bias = torch.randn(200, generator=torch.Generator().manual_seed(7))
    shapes: list[tuple[int, ...]] = []
    op = torch.ops.mkldnn._linear_pointwise

    def spy(*args: torch.Tensor) -> torch.Tensor:
        shapes.append(tuple(args[0].shape))
        return op(*args)

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", spy)
    out = matmul_t(x[:, :96], weight, bias)
    assert shapes == [(onednn_rows(rows), 96)] and onednn_rows(rows) > rows
    assert out.shape == (rows, 200) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


def mixer_args(dtype: torch.dtype, batch: int) -> dict[str, torch.Tensor]:
    d_model, d_inner, d_state, dt_rank, width = 40, 72, 8, 5, 4
    g = torch.Generator().manual_seed(batch)

    def weight(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) / shape[-1] ** 0.5).to(dtype)

    slots = batch + 3
    return {
        "h": torch.randn(batch, d_model, generator=g).to(dtype),
        "in_proj_weight": weight(2 * d_inner, d_model),
        "in_proj_bias": None,
        "conv_pool": torch.randn(slots, d_inner, width - 1, generator=g),
        "conv_weight": torch.randn(d_inner, width, generator=g) / 2,
        "conv_bias": torch.randn(d_inner, generator=g) * 0.1,
        "slot_ids": torch.randperm(slots, generator=g)[:batch],
        "x_proj_weight": weight(dt_rank + 2 * d_state, d_inner),
        "dt_proj_weight": weight(d_inner, dt_rank),
        "dt_bias": torch.rand(d_inner, generator=g) - 4,
        "A": -torch.rand(d_inner, d_state, generator=g) * 4,
        "D": torch.randn(d_inner, generator=g),
        "ssm_pool": torch.randn(slots, d_inner, d_state, generator=g),
        "out_proj_weight": weight(d_model, d_inner),
        "out_proj_bias": None,
    }


@pytest.mark.parametrize("enabled", [True, False])
@pytest.mark.parametrize("batch", [1, 5])
@torch.inference_mode()
def test_fused_mamba_step_with_and_without_the_kernel_matches_reference(
    enabled: bool, batch: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fused Mamba op takes the switch too (its projections are the kernel's main users)."""
    monkeypatch.setattr(gemv_module, "ENABLED", enabled)
    args = mixer_args(torch.float32, batch)
    ref_args = {name: None if t is None else t.clone() for name, t in args.items()}
    out = mamba_mixer_decode(**args)
    expected = mamba_mixer_decode_ref(**ref_args)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(args["ssm_pool"], ref_args["ssm_pool"], rtol=1e-4, atol=1e-5)
