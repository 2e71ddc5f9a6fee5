"""``benchmarks/arrivals.py`` at tiny sizes: both settings serve every request on the emulated device (whose
prefill calls take their time) and the table has a row each, the baseline at 1.00x."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(300)
def test_arrivals_bench_serves_both_settings() -> None:
    command = [sys.executable, str(ROOT / "benchmarks" / "arrivals.py"), "--rounds", "1", "--concurrency", "4",
               "--requests", "12", "--output-len", "8", "--step-ms", "2", "--prefill-ms", "20"]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=280, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in result.stdout.splitlines()]
    rows = [r for r in rows if r and r[0].isdigit()]
    assert [r[0] for r in rows] == ["0", "32"], result.stdout
    assert rows[0][2] == "1.00x", result.stdout
    assert all(float(r[1]) > 0 and float(r[4]) > 0 for r in rows), result.stdout  # a rate and a TTFT each
