"""``benchmarks/http_stack.py`` at tiny sizes: both stacks serve every load and the table has a row each, with
the baseline's ratios at 1.00x."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(300)
def test_http_stack_bench_runs_both_stacks() -> None:
    command = [sys.executable, str(ROOT / "benchmarks" / "http_stack.py"), "--rounds", "1", "--streams", "4",
               "--output-len", "2", "--requests", "4", "--step-ms", "1", "--stacks", "h11+asyncio",
               "httptools+uvloop"]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=280, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in result.stdout.splitlines() if line.startswith("| h")]
    assert [(r[0].strip(), r[1].strip()) for r in rows] == [("h11", "asyncio"), ("httptools", "uvloop")]
    baseline = rows[0]
    assert [c.strip() for c in baseline if c.strip().endswith("x")] == ["1.00x"] * 5, result.stdout
    assert all(float(c) > 0 for c in rows[1][2:] if not c.strip().endswith("x")), result.stdout
