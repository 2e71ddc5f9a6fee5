"""``benchmarks/multi_turn.py --smoke`` runs its three real servers and prints a table in which the prefix cache
skipped prompt tokens and changed no reply, and sessions skipped their history and replied the same."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_multi_turn_smoke_reports_cache_hits_and_identical_replies() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "multi_turn.py"), "--smoke"],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {line[:12].strip(): line[12:].split() for line in result.stdout.splitlines()}
    on, off, sessions = rows["cache on"], rows["cache off"], rows["sessions"]
    assert len(on) == len(off) == len(sessions) == 7, result.stdout  # TTFT p50/mean, turn 1 and later; tokens; s
    prefilled, hits = 4, 5
    assert float(on[hits]) > 0 and float(off[hits]) == 0, result.stdout
    assert float(on[prefilled]) + float(on[hits]) == float(off[prefilled]), result.stdout
    # Later turns send their message only. (Not compared with the cache's run: whether the two first turns, sent at
    # once, share a snapshot of the system prompt depends on the step each is admitted in.)
    assert float(sessions[prefilled]) < float(off[prefilled]), result.stdout
    assert "replies identical with and without the cache: yes" in result.stdout
    assert "replies identical in sessions: yes" in result.stdout
