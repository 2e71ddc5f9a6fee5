"""``benchmarks/http_overhead.py`` end to end on a tiny model: a real ``rnnserve serve`` under ``rnnserve bench``
and the offline worker, one table row per dtype and stream count. Its figures are not checked (timing belongs
in the benchmark); its plumbing is: both sides serve every token, and the OpenMP policy reaches both."""

from __future__ import annotations

import re

import pytest

from benchmarks import http_overhead


def test_bench_prompts_are_the_ones_rnnserve_bench_sends() -> None:
    first = http_overhead.token_prompts(3, 5, 100, seed=7)
    assert first == http_overhead.token_prompts(3, 5, 100, seed=7)
    assert len(first) == 3 and all(len(p) == 5 and all(0 <= t < 100 for t in p) for p in first)


def test_runs_both_sides_and_prints_one_row_per_dtype_and_streams(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    argv = ["--preset", "mamba-tiny", "--dtypes", "float32", "--streams", "1", "3", "--prompt-len", "4",
            "--output-len", "3", "--rounds", "1", "--warmup", "0", "--threads", "1"]  # fmt: skip
    http_overhead.main(argv)
    out = capsys.readouterr().out
    assert "GOMP_SPINCOUNT=10000" in out
    rows = [line for line in out.splitlines() if line.startswith("| float32 |")]
    assert len(rows) == 2
    for row, streams in zip(rows, ("1", "3"), strict=True):
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        assert cells[1] == streams
        assert float(cells[2]) > 0 and float(cells[3]) > 0
        assert re.fullmatch(r"\d+%", cells[4])
