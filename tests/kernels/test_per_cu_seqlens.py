"""Host-side tables built from ``cu_seqlens`` once per tensor: one device-to-host read per batch, not per layer."""

from __future__ import annotations

import torch

from rnnserve.kernels import backend
from rnnserve.kernels.backend import per_cu_seqlens


def _counting(calls: list[list[int]]):
    def build(bounds: list[int]) -> int:
        calls.append(bounds)
        return bounds[-1]

    return build


def test_built_once_per_tensor_and_key():
    calls: list[list[int]] = []
    cu = torch.tensor([0, 3, 5])
    assert per_cu_seqlens(cu, "a", _counting(calls)) == 5
    assert per_cu_seqlens(cu, "a", _counting(calls)) == 5
    assert per_cu_seqlens(cu, "b", _counting(calls)) == 5
    assert per_cu_seqlens(torch.tensor([0, 3, 5]), "a", _counting(calls)) == 5  # another tensor: its own table
    assert len(calls) == 3


def test_an_in_place_change_rebuilds_and_inference_tensors_are_cached():
    calls: list[list[int]] = []
    cu = torch.tensor([0, 3, 5])
    per_cu_seqlens(cu, "a", _counting(calls))
    cu[2] = 9
    assert per_cu_seqlens(cu, "a", _counting(calls)) == 9 and len(calls) == 2
    with torch.inference_mode():
        frozen = torch.tensor([0, 4])
        assert per_cu_seqlens(frozen, "a", _counting(calls)) == 4
        assert per_cu_seqlens(frozen, "a", _counting(calls)) == 4
    assert len(calls) == 3


def test_repeated_layers_build_each_table_once(triton_on_cpu, monkeypatch):
    """Three layers' calls of the SSD and the Mamba-1 scan on one ``cu_seqlens`` build each kernel's table once."""
    from rnnserve.kernels.selective_scan.chunk import selective_scan_varlen_triton
    from rnnserve.kernels.ssd.chunk import ssd_scan_varlen_triton

    reads: list[int] = []
    original = backend.per_cu_seqlens

    def spy(cu_seqlens, key, build):
        return original(cu_seqlens, key, lambda bounds: reads.append(1) or build(bounds))

    monkeypatch.setattr("rnnserve.kernels.ssd.chunk.per_cu_seqlens", spy)
    monkeypatch.setattr("rnnserve.kernels.selective_scan.chunk.per_cu_seqlens", spy)
    cu = torch.tensor([0, 20, 23])
    gen = torch.Generator().manual_seed(0)
    ssd = {"x": torch.randn(23, 2, 16, generator=gen), "dt": torch.rand(23, 2, generator=gen), "A": -torch.ones(2),
           "B": torch.randn(23, 1, 16, generator=gen), "C": torch.randn(23, 1, 16, generator=gen)}
    scan = {"x": torch.randn(23, 8, generator=gen), "dt": torch.rand(23, 8, generator=gen),
            "A": -torch.ones(8, 4), "B": torch.randn(23, 4, generator=gen), "C": torch.randn(23, 4, generator=gen)}
    for _ in range(3):  # three layers
        first = ssd_scan_varlen_triton(**ssd, cu_seqlens=cu, chunk_size=16)
        again = selective_scan_varlen_triton(**scan, cu_seqlens=cu, segment_len=8)
    assert len(reads) == 2  # one table per kernel, not per call
    assert first[0].shape == (23, 2, 16) and again[0].shape == (23, 8)


def test_a_prefill_batch_never_reads_its_bounds_back(monkeypatch):
    """``PrefillBatch.build`` attaches the host offsets it copied to the device: building the tables reads no
    tensor (on a GPU such a read would wait for every queued step, which async scheduling must not)."""
    from rnnserve.engine.models.base import PrefillBatch

    batch = PrefillBatch.build([[1, 2, 3], [4], [5, 6]], [0, 2, 1])

    def no_read(self):  # type: ignore[no-untyped-def]
        raise AssertionError("cu_seqlens was read back")

    monkeypatch.setattr(torch.Tensor, "tolist", no_read)
    calls: list[list[int]] = []
    assert per_cu_seqlens(batch.cu_seqlens, "a", _counting(calls)) == 6
    assert calls == [[0, 3, 4, 6]]


def test_int64_table_of_lists_tensors_and_nothing():
    """Lists cross through an int64 array: the same values as ``torch.tensor``, extremes included, and a
    tensor of their own (a later change to the list does not show)."""
    values = [0, -1, 2**63 - 1, -(2**63), 7]
    table = backend.int64_table(values, "cpu")
    assert table.dtype == torch.int64 and table.tolist() == values
    values[0] = 5
    assert table[0] == 0
    assert backend.int64_table([], "cpu").shape == (0,)
    assert backend.int64_table(torch.tensor([3, 4], dtype=torch.int32), "cpu").dtype == torch.int64
