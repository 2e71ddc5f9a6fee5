"""``benchmarks/sse_ab.py`` against this very checkout, a few short streams: its plumbing (two workers in turns, the
engine in a process of its own, the client's checks, the table) works and the driver threads' parts are measured;
the timings themselves are not checked."""

from __future__ import annotations

import pytest

from benchmarks import sse_ab
from benchmarks.host_ab import ROOT


def test_compares_a_checkout_with_itself(capsys: pytest.CaptureFixture[str]) -> None:
    sse_ab.main(["--base", str(ROOT), "--concurrency", "4", "--output-len", "4", "--requests-per-stream", "1",
                 "--step-ms", "5", "--rounds", "1", "--port", "0"])  # fmt: skip
    lines = capsys.readouterr().out.splitlines()
    header = lines[1].split()
    assert header[:4] == ["load", "base", "this", "this/base"] and header.count("read") == header.count("send") == 2
    rows = {line[:34].strip(): line[34:].split() for line in lines[2:]}
    assert set(rows) == {"completions", "completions, include_usage", "chat", "chat, include_usage"}
    for base, this, _, _, _, read_base, read_this, send_base, send_this, *_ in rows.values():
        # the reader thread unpickles and decodes every step's outputs, the command thread acknowledges each: parts
        # of the process's CPU, never all of it
        for part_base, part_this in ((read_base, read_this), (send_base, send_this)):
            assert 0 < float(part_base) < float(base) and 0 < float(part_this) < float(this)
