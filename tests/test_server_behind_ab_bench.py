"""``benchmarks/server_behind_ab.py`` against this very checkout, a few short turns: its plumbing (two workers in
turns, a server behind in turn or none, the summary line) works; the timings themselves are not checked."""

from __future__ import annotations

import re

import pytest

from benchmarks import server_behind_ab
from benchmarks.host_ab import ROOT

LINE = re.compile(r"hold (\d+), (\d+) servers: collections with a server behind (\d+)%; loop us/token this (\S+), "
                  r"base (\S+); this / base (\S+) \(quartiles (\S+)-(\S+)\)")


@pytest.mark.parametrize("hold", [0, 2])
def test_compares_a_checkout_with_itself(capsys: pytest.CaptureFixture[str], hold: int) -> None:
    server_behind_ab.main(["--base", str(ROOT), "--batch", "8", "--servers", "2", "--hold", str(hold),
                           "--chunks", "2", "--chunk", "4"])
    match = LINE.search(capsys.readouterr().out)
    assert match, "no summary line"
    assert match[1] == str(hold) and match[2] == "2"
    assert (int(match[3]) > 0) == (hold > 0)  # a server holding its messages is behind at some collections
    assert float(match[4]) > 0 and float(match[5]) > 0 and float(match[6]) > 0
