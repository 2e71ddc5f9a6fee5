"""Every Triton kernel == its PyTorch reference on a CUDA device at realistic sizes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rnnserve.kernels.add_norm import add_norm
from rnnserve.kernels.add_norm.naive import add_norm_ref
from rnnserve.kernels.causal_conv1d import causal_conv1d_update, causal_conv1d_varlen
from rnnserve.kernels.causal_conv1d.naive import causal_conv1d_update_ref, causal_conv1d_varlen_ref
from rnnserve.kernels.diag_linear_scan import diag_linear_scan, diag_log_scan, diag_scan_step
from rnnserve.kernels.diag_linear_scan.naive import diag_linear_scan_ref, diag_log_scan_ref, diag_scan_step_ref
from rnnserve.kernels.min_rnn_step import min_rnn_step
from rnnserve.kernels.min_rnn_step.naive import min_rnn_step_ref

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEVICE = "cuda"
LENGTHS = [1, 3, 64, 65, 500, 1024, 1, 2047]


def _cu_seqlens(lengths: list[int]) -> torch.Tensor:
    return F.pad(torch.tensor(lengths).cumsum(0), (1, 0)).to(DEVICE)


def _slots(batch: int, num_slots: int) -> torch.Tensor:
    return torch.randperm(num_slots, generator=torch.Generator().manual_seed(0))[:batch].to(DEVICE)


def _tol(dtype: torch.dtype) -> dict[str, float]:
    return {"rtol": 1e-4, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 3e-2}


@pytest.mark.parametrize("log_space", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_size", [16, 64])  # Triton tiles of 16 and 32 steps
def test_diag_scan(log_space, dtype, chunk_size):
    dim, total = 1536, sum(LENGTHS)
    k, v = torch.randn(2, total, dim, device=DEVICE).unbind(0)
    if log_space:
        a, b = -F.softplus(k), -F.softplus(-k) + 0.3 * v
    else:
        a, b = torch.sigmoid(k), v
    a, b = a.to(dtype), b.to(dtype)
    cu = _cu_seqlens(LENGTHS)
    h0 = torch.rand(len(LENGTHS), dim, device=DEVICE)
    h0[0] = 0.0
    scan, ref = (diag_log_scan, diag_log_scan_ref) if log_space else (diag_linear_scan, diag_linear_scan_ref)
    h, final = scan(a, b, cu, h0, chunk_size=chunk_size)
    h_ref, final_ref = ref(a, b, cu, h0)
    torch.testing.assert_close(h, h_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(final, final_ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("log_space", [False, True])
def test_diag_scan_step(log_space):
    batch, num_slots, dim = 256, 300, 4096
    a, b = torch.randn(2, batch, dim, device=DEVICE).unbind(0)
    if not log_space:
        a = torch.sigmoid(a)
    else:
        a = -F.softplus(a)
    pool = torch.rand(num_slots, 2, dim, device=DEVICE)
    expected = pool.clone()
    slots = _slots(batch, num_slots)
    h = diag_scan_step(a, b, pool[:, 1], slots, log_space)
    expected[slots, 1] = diag_scan_step_ref(a, b, expected[slots, 1], log_space)
    torch.testing.assert_close(h, expected[slots, 1])
    torch.testing.assert_close(pool, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [2, 4])
def test_causal_conv1d(dtype, width):
    channels, total = 2048, sum(LENGTHS)
    x = torch.randn(total, channels, device=DEVICE).to(dtype)
    weight = torch.randn(channels, width, device=DEVICE).to(dtype)
    bias = torch.randn(channels, device=DEVICE).to(dtype)
    cu = _cu_seqlens(LENGTHS)
    h0 = torch.randn(len(LENGTHS), channels, width - 1, device=DEVICE)
    y, final = causal_conv1d_varlen(x, weight, bias, cu, h0)
    y_ref, final_ref = causal_conv1d_varlen_ref(x, weight, bias, cu, h0)
    torch.testing.assert_close(y, y_ref, **_tol(dtype))
    torch.testing.assert_close(final, final_ref)

    batch, num_slots = 256, 300
    pool = torch.randn(num_slots, 3, channels, width - 1, device=DEVICE)
    expected = pool.clone()
    slots = _slots(batch, num_slots)
    x = torch.randn(batch, channels, device=DEVICE).to(dtype)
    y = causal_conv1d_update(x, pool[:, 2], weight, bias, slots)
    y_ref, new_state = causal_conv1d_update_ref(x, expected[slots, 2], weight, bias)
    expected[slots, 2] = new_state
    torch.testing.assert_close(y, y_ref, **_tol(dtype))
    torch.testing.assert_close(pool, expected)


@pytest.mark.parametrize("cell, projections", [("mingru", 2), ("minlstm", 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_min_rnn_step(cell, projections, dtype):
    batch, num_slots, dim = 256, 300, 4096
    proj = (3 * torch.randn(batch, projections * dim, device=DEVICE)).to(dtype)
    pool = torch.rand(num_slots, 4, dim, device=DEVICE)
    expected = pool.clone()
    slots = _slots(batch, num_slots)
    h = min_rnn_step(proj, pool[:, 3], slots, cell)
    expected[slots, 3] = min_rnn_step_ref(proj, expected[slots, 3], cell)
    torch.testing.assert_close(h, expected[slots, 3].to(dtype), **_tol(dtype))
    torch.testing.assert_close(pool, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_norm(rms, dtype):
    rows, width = 4096, 2048
    x, residual = (torch.randn(2, rows, width, device=DEVICE) * 2).to(dtype).unbind(0)
    weight = torch.randn(width, device=DEVICE).to(dtype)
    bias = None if rms else torch.randn(width, device=DEVICE).to(dtype)
    normed, summed = add_norm(x, residual, weight, bias, 1e-5, rms)
    normed_ref, summed_ref = add_norm_ref(x, residual, weight, bias, 1e-5, rms)
    torch.testing.assert_close(summed, summed_ref, **_tol(dtype))
    torch.testing.assert_close(normed, normed_ref, **_tol(dtype))


@pytest.mark.parametrize(("stream_dtype", "weight_dtype"), [(torch.float32, torch.bfloat16), (torch.bfloat16,
                                                                                             torch.bfloat16)])
@pytest.mark.parametrize("round_to_weight_dtype", [True, False])
def test_residual_rms_norm_rounds_as_the_reference(stream_dtype, weight_dtype, round_to_weight_dtype):
    """Mamba's block norm at mamba-370m width: every bf16 rounding where the reference rounds (the new stream
    bit for bit; the normed row within one ulp on under 1% of elements, the sum of squares' order differs)."""
    from rnnserve.kernels.residual_rms_norm import residual_rms_norm
    from rnnserve.kernels.residual_rms_norm.naive import residual_rms_norm_ref

    gen = torch.Generator(device=DEVICE).manual_seed(0)
    stream = (torch.randn(256, 1024, device=DEVICE, generator=gen) * 3).to(stream_dtype)
    delta = torch.randn(256, 1024, device=DEVICE, generator=gen).to(weight_dtype)
    weight = (torch.rand(1024, device=DEVICE, generator=gen) + 0.5).to(weight_dtype)
    normed, new_stream = residual_rms_norm(stream, delta, weight, 1e-5, round_to_weight_dtype)
    normed_ref, stream_ref = residual_rms_norm_ref(stream, delta, weight, 1e-5, round_to_weight_dtype)
    assert torch.equal(new_stream, stream_ref)
    torch.testing.assert_close(normed, normed_ref, rtol=2**-7, atol=0)
    assert (normed != normed_ref).float().mean() < 0.01


@pytest.mark.parametrize("groups", [1, 4])
def test_gated_rms_norm_rounds_as_the_reference(groups):
    """Mamba-2's gated group norm at mamba2-370m width, z a column slice of the in_proj output: within one bf16
    ulp of the op-by-op reference on under 1% of elements (the sum of squares' order and exp differ)."""
    from rnnserve.kernels.gated_rms_norm import gated_rms_norm
    from rnnserve.kernels.gated_rms_norm.naive import gated_rms_norm_ref

    gen = torch.Generator(device=DEVICE).manual_seed(0)
    y = torch.randn(300, 2048, device=DEVICE, generator=gen)
    projected = torch.randn(300, 4384, device=DEVICE, generator=gen).to(torch.bfloat16)
    z = projected[:, :2048]
    weight = (torch.rand(2048, device=DEVICE, generator=gen) + 0.5).to(torch.bfloat16)
    out = gated_rms_norm(y, z, weight, groups, 1e-5)
    ref = gated_rms_norm_ref(y, z, weight, groups, 1e-5)
    assert out.dtype == ref.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.float(), rtol=2**-7, atol=0)
    assert (out != ref).float().mean() < 0.01
