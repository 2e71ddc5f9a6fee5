"""The selective-scan op: time-major varlen prefill and in-place decode update == token-by-token reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rnnserve.kernels.cpu_extension import cpu_ops
from rnnserve.kernels.selective_scan import selective_scan_varlen, selective_state_update
from rnnserve.kernels.selective_scan.naive import selective_scan_ref
from rnnserve.kernels.selective_scan.torch_chunked import selective_scan_chunked
from rnnserve.kernels.selective_scan.torch_recurrent import selective_state_update_torch


def _inputs(lengths: list[int], d_inner: int = 6, d_state: int = 5, optional: bool = True) -> dict:
    """Random scan inputs; ``optional=False`` leaves out D, z and dt's bias/softplus (dt given positive)."""
    g = torch.Generator().manual_seed(0)
    total = sum(lengths)
    dt = torch.randn(total, d_inner, generator=g) * 2
    args = {
        "x": torch.randn(total, d_inner, generator=g),
        "dt": dt if optional else F.softplus(dt),
        "A": -torch.rand(d_inner, d_state, generator=g) * 4,
        "B": torch.randn(total, d_state, generator=g),
        "C": torch.randn(total, d_state, generator=g),
        "cu_seqlens": torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()]),
        "D": torch.randn(d_inner, generator=g),
        "z": torch.randn(total, d_inner, generator=g),
        "initial_state": torch.randn(len(lengths), d_inner, d_state, generator=g),
        "dt_bias": torch.randn(d_inner, generator=g) + 12,  # some dt past softplus' linear threshold (20)
        "dt_softplus": True,
    }
    if not optional:
        args.update(D=None, z=None, dt_bias=None, dt_softplus=False)
    return args


needs_cpu_kernels = pytest.mark.skipif(not cpu_ops(), reason="fused CPU kernels could not be built")


@pytest.mark.parametrize("chunk_size", [1, 3, 32])
@pytest.mark.parametrize("lengths", [[1], [5, 1, 9, 4], [17, 17, 2]])
def test_chunked_matches_reference(lengths: list[int], chunk_size: int) -> None:
    args = _inputs(lengths)
    y_ref, h_ref = selective_scan_ref(**args)
    y, h = selective_scan_chunked(**args, chunk_size=chunk_size)
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h, h_ref, atol=1e-5, rtol=1e-5)


@needs_cpu_kernels
@pytest.mark.parametrize("optional", [True, False])
@pytest.mark.parametrize("d_inner", [6, 16, 37, 300])
@pytest.mark.parametrize("lengths", [[1], [5, 1, 9, 4], [40, 17, 2]])
def test_fused_cpu_scan_matches_reference(lengths: list[int], d_inner: int, optional: bool) -> None:
    args = _inputs(lengths, d_inner=d_inner, d_state=16, optional=optional)
    y_ref, h_ref = selective_scan_ref(**args)
    initial = args["initial_state"].clone()
    y, h = selective_scan_varlen(**args)
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h, h_ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(args["initial_state"], initial)


@pytest.mark.parametrize(
    "update", [selective_state_update_torch, pytest.param(selective_state_update, marks=needs_cpu_kernels)]
)
@pytest.mark.parametrize("consecutive", [True, False])
@pytest.mark.parametrize(("d_inner", "d_state"), [(6, 5), (300, 16)])  # 300: 16-channel groups and a tail
def test_state_update_in_place_matches_reference(consecutive: bool, update, d_inner: int, d_state: int) -> None:
    lengths = [1, 1, 1]
    args = _inputs(lengths, d_inner=d_inner, d_state=d_state)
    y_ref, h_ref = selective_scan_ref(**args)
    pool = torch.randn(6, d_inner, d_state)
    slot_ids = torch.tensor([2, 3, 4]) if consecutive else torch.tensor([4, 0, 2])
    pool[slot_ids] = args["initial_state"]
    untouched = pool[[1, 5]].clone()
    slots = slice(2, 5) if consecutive else slot_ids
    step = {k: args[k] for k in ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "dt_softplus")}
    y = update(pool, slots, **step)
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool[slot_ids], h_ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(pool[[1, 5]], untouched)


@needs_cpu_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_cpu_kernels_read_strided_and_bf16_activations(dtype: torch.dtype) -> None:
    """x, dt, z, B, C as GEMM outputs arrive: transposed views and column slices, in fp32 or bf16."""
    lengths = [7, 1, 12]
    args = _inputs(lengths, d_inner=24, d_state=16)
    for name in ("x", "dt", "z"):  # transposed views, as (W @ x^T)^T leaves them
        args[name] = args[name].to(dtype).t().contiguous().t()
    packed = torch.cat([args["B"], args["C"]], dim=1).to(dtype)  # column slices of one projection
    args["B"], args["C"] = packed[:, :16], packed[:, 16:]
    reference = {k: v.float() if isinstance(v, torch.Tensor) and v.dtype == dtype else v for k, v in args.items()}
    y_ref, h_ref = selective_scan_ref(**reference)
    y, h = selective_scan_varlen(**args)
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h, h_ref, atol=1e-5, rtol=1e-5)

    pool = torch.randn(5, 24, 16)
    slot_ids = torch.tensor([4, 0, 2])
    pool[slot_ids] = reference["initial_state"]
    first = torch.tensor([0, 7, 8])  # each sequence's first token
    step = dict(args)
    for name in ("x", "dt", "z"):
        step[name] = args[name][first].t().contiguous().t()
    step["B"], step["C"] = packed[first][:, :16], packed[first][:, 16:]
    assert not step["x"].is_contiguous() and not step["B"].is_contiguous()
    y_step = selective_state_update(
        pool, slot_ids, *(step[k] for k in ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "dt_softplus"))
    )
    torch.testing.assert_close(y_step, y_ref[first], atol=1e-5, rtol=1e-5)
