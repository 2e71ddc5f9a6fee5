"""The PyTorch (CPU) paths of the conv dispatch functions equal the reference."""

from __future__ import annotations

import pytest
import torch

from kernels.causal_conv1d import causal_conv1d_update, causal_conv1d_varlen
from kernels.causal_conv1d.naive import causal_conv1d_update_ref, causal_conv1d_varlen_ref


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
        y, final = causal_conv1d_varlen(x, weight, bias, cu, initial)
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
    y = causal_conv1d_update(x, pool, weight, bias, slots)
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=0)
    assert torch.equal(pool[slots], new_ref)
    others = torch.tensor([1, 3, 4, 5, 6, 8])
    assert torch.equal(pool[others], before[others])
