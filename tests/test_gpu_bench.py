"""``make gpu-bench`` and the scan tuner stay runnable without a GPU: their CPU smoke modes measure every row kind
(HTTP included) and every choice."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_bench_smoke_prints_every_row_kind():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_bench.py"), "--smoke", "--models", "mamba-tiny"],
        capture_output=True, text=True, timeout=300, env=env, cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line.split() for line in result.stdout.splitlines()]
    kinds = {(row[1], row[2]) for row in lines if row and row[0] == "mamba-tiny"}
    assert kinds == {("decode", "b=1"), ("decode", "b=4"), ("prefill", "1x64"), ("prefill", "2x16"),
                     ("engine", "c=2"), ("HTTP", "c=2")}, result.stdout
    http = next(row for row in lines if row[:3] == ["mamba-tiny", "HTTP", "c=2"])
    assert float(http[3]) > 0 and http[4].endswith("%"), http  # a rate and its ratio to offline, not a failure


def test_scan_tune_smoke_times_each_choice_on_both_shapes():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "scan_tune.py"), "--smoke"],
                            capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line.split() for line in result.stdout.splitlines()[1:]]
    assert sorted((row[0], row[1]) for row in rows) == [("1x40", "(8,"), ("1x40", "default"), ("2x16", "(8,"),
                                                        ("2x16", "default")], result.stdout
