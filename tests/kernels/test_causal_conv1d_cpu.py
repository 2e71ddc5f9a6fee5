"""The CPU paths of the conv op (the PyTorch paths and the fused C++ kernels) equal the reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rnnserve.kernels.causal_conv1d import causal_conv1d_update, causal_conv1d_varlen
from rnnserve.kernels.causal_conv1d.naive import causal_conv1d_update_ref, causal_conv1d_varlen_ref
from rnnserve.kernels.causal_conv1d.torch_recurrent import causal_conv1d_update_torch
from rnnserve.kernels.causal_conv1d.torch_varlen import causal_conv1d_varlen_torch
from rnnserve.kernels.cpu_extension import cpu_ops


@pytest.mark.parametrize("width", [2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shifted_varlen_conv_equals_reference(width: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(width)
    lengths = [1, 2, 3, 67, 5, 1, 40]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    channels = 24
    x = torch.randn(cu[-1].item(), channels, generator=g).to(dtype)
    weight, bias = torch.randn(channels, width, generator=g), torch.randn(channels, generator=g)
    tails = torch.randn(len(lengths), channels, width - 1, generator=g)
    for initial in (None, tails):
        y, final = causal_conv1d_varlen_torch(x, weight, bias, cu, initial)
        y_ref, final_ref = causal_conv1d_varlen_ref(x, weight, bias, cu, initial)
        assert y.dtype == dtype and final.dtype == torch.float32
        torch.testing.assert_close(y.float(), y_ref.float(), atol=1e-5 if dtype == torch.float32 else 2e-2, rtol=0)
        assert torch.equal(final, final_ref)


def test_pool_update_equals_reference_with_gapped_slots() -> None:
    g = torch.Generator().manual_seed(0)
    pool = torch.randn(10, 16, 3, generator=g)
    slots = torch.tensor([7, 2, 9, 0])
    x, weight, bias = torch.randn(4, 16, generator=g), torch.randn(16, 4, generator=g), torch.randn(16, generator=g)
    y_ref, new_ref = causal_conv1d_update_ref(x, pool[slots], weight, bias)
    before = pool.clone()
    y = causal_conv1d_update_torch(x, pool, weight, bias, slots)
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=0)
    assert torch.equal(pool[slots], new_ref)
    others = torch.tensor([1, 3, 4, 5, 6, 8])
    assert torch.equal(pool[others], before[others])


@pytest.mark.skipif(not cpu_ops(), reason="fused CPU kernels could not be built")
@pytest.mark.parametrize("silu", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_cpu_update_reads_strided_views(dtype: torch.dtype, silu: bool) -> None:
    """The C++ update on a transposed input (a ``W @ x^T`` GEMM output) and a layer view of a multi-layer
    pool equals the reference, bit for bit in the pool, and leaves the other layers and slots alone."""
    g = torch.Generator().manual_seed(1)
    channels, width, layers = 40, 4, 3
    pool = torch.randn(9, layers, channels, width - 1, generator=g)
    layer_view = pool[:, 1]
    slots = torch.tensor([5, 0, 8, 2, 7])
    x = torch.randn(channels, len(slots), generator=g).to(dtype).t()
    weight, bias = torch.randn(channels, width, generator=g), torch.randn(channels, generator=g)
    y_ref, new_ref = causal_conv1d_update_ref(x.float(), layer_view[slots], weight, bias)
    if silu:  # on the conv's output rounded to x's dtype, as F.silu after the conv (the model's PyTorch path)
        y_ref = F.silu(y_ref.to(dtype)).float()
    before = pool.clone()
    y = causal_conv1d_update(x, layer_view, weight, bias, slots, silu=silu)
    assert y.dtype == dtype and y.is_contiguous()
    if dtype == torch.float32:
        torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=0)
    else:  # one rounding of the fp32 result (with the SiLU, the same roundings as the reference's bf16 ops)
        torch.testing.assert_close(y.float(), y_ref, atol=1e-6, rtol=2**-8)
    assert torch.equal(layer_view[slots], new_ref)
    changed = torch.zeros_like(pool, dtype=torch.bool)
    changed[slots, 1] = True
    assert torch.equal(pool[~changed], before[~changed])


@pytest.mark.skipif(not cpu_ops(), reason="fused CPU kernels could not be built")
def test_fused_cpu_update_equals_pytorch_path_without_bias() -> None:
    g = torch.Generator().manual_seed(2)
    pool = torch.randn(6, 16, 2, generator=g)
    slots = torch.tensor([3, 1])
    x, weight = torch.randn(2, 16, generator=g), torch.randn(16, 3, generator=g)
    pool_torch = pool.clone()
    y = causal_conv1d_update(x, pool, weight, None, slots)
    y_torch = causal_conv1d_update_torch(x, pool_torch, weight, None, slots)
    torch.testing.assert_close(y, y_torch, atol=1e-6, rtol=0)
    assert torch.equal(pool, pool_torch)


@pytest.mark.skipif(not cpu_ops(), reason="fused CPU kernels could not be built")
@pytest.mark.parametrize("silu", [False, True])
@pytest.mark.parametrize("width", [2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_cpu_varlen_equals_reference(dtype: torch.dtype, width: int, silu: bool) -> None:
    """The C++ prefill on a column slice of a wider projection (as ``in_proj(h).chunk(2)`` leaves it), over
    more than one 256-channel block, with strided initial tails and sequences shorter than the tail."""
    g = torch.Generator().manual_seed(width)
    lengths = [1, 2, 3, 67, 5, 1, 40]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    channels = 300
    x = torch.randn(cu[-1].item(), 2 * channels, generator=g).to(dtype)[:, :channels]
    weight, bias = torch.randn(channels, width, generator=g), torch.randn(channels, generator=g)
    pool = torch.randn(len(lengths), 2, channels, width - 1, generator=g)
    for initial in (None, pool[:, 1]):
        for b in (bias, None):
            y, final = causal_conv1d_varlen(x, weight, b, cu, initial, silu=silu)
            y_ref, final_ref = causal_conv1d_varlen_ref(x.float(), weight, b, cu, initial)
            if silu:  # on the conv's output rounded to x's dtype, as F.silu after the conv
                y_ref = F.silu(y_ref.to(dtype)).float()
            assert y.dtype == dtype and final.dtype == torch.float32
            if dtype == torch.float32:
                torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=0)
            elif not silu:  # one rounding of the fp32 result
                torch.testing.assert_close(y.float(), y_ref, atol=1e-6, rtol=2**-8)
            else:  # the reference's two roundings; a conv output summed in another order may round the other way
                torch.testing.assert_close(y.float(), y_ref, atol=1e-6, rtol=2**-6)
                assert (y.float() != y_ref).float().mean() < 1e-3
            assert torch.equal(final, final_ref)
