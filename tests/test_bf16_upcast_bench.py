"""``benchmarks/bf16_upcast.py`` on a tiny preset: one row per prefill and decode case with both paths timed, and
the engine's switch restored afterwards. Its ratios are not checked (timing belongs in the benchmark)."""

from __future__ import annotations

import pytest

from benchmarks import bf16_upcast
from rnnserve.kernels import gemv


def test_prints_both_paths_for_every_case_and_restores_the_switch(capsys: pytest.CaptureFixture[str]) -> None:
    before = gemv.UPCAST_BF16_GEMM
    bf16_upcast.main(["--preset", "mamba-tiny", "--prefills", "2x16", "--batches", "70", "--repeats", "1",
                      "--rounds", "2"])  # fmt: skip
    assert gemv.UPCAST_BF16_GEMM == before == (not gemv.native_bf16_gemm())
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith(("prefill", "decode"))]
    assert [" ".join(r[:-3]) for r in rows] == ["prefill 2x16", "decode batch 70"]
    for row in rows:
        aten, upcast, ratio = float(row[-3]), float(row[-2]), float(row[-1].rstrip("x"))
        assert aten > 0 and upcast > 0
        assert ratio == pytest.approx(upcast / aten, rel=0.01, abs=0.01)
