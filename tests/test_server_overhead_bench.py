"""``benchmarks/server_overhead.py`` at tiny sizes, with the scripted engine and with the real one in a process:
every request through the real app succeeds (the benchmark raises otherwise) and the table has a row per endpoint
and load, with positive CPU figures."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("engine", ["scripted", "process"])
def test_server_overhead_bench_measures_both_endpoints(engine: str) -> None:
    command = [sys.executable, str(ROOT / "benchmarks" / "server_overhead.py"), "--engine", engine, "--rounds", "2",
               "--requests", "6", "--concurrency", "3", "--output-len", "4"]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {}
    for line in result.stdout.splitlines():
        if line.startswith(("completions:", "chat:")):
            name, *values = line.rsplit(maxsplit=3)
            rows[name.strip()] = [float(v) for v in values]
    loads = ("per one-token request", "per chunk, streams of 4 tokens")
    assert sorted(rows) == sorted(f"{endpoint}: {load}" for endpoint in ("completions", "chat") for load in loads)
    assert all(value > 0 for values in rows.values() for value in values), result.stdout
