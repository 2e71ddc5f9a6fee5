"""``benchmarks/host_ab.py`` against this very checkout, a few short chunks: its plumbing (two workers in turns,
one row per part both timed, the ratio column) works; the timings themselves are not checked."""

from __future__ import annotations

import re

import pytest

from benchmarks import host_ab


def test_compares_a_checkout_with_itself(capsys: pytest.CaptureFixture[str]) -> None:
    host_ab.main(["--base", str(host_ab.ROOT), "--batch", "8", "--chunks", "4", "--chunk", "3"])
    out = capsys.readouterr().out
    table = out.split("this / base\n", 1)[1].splitlines()
    parsed = [re.fullmatch(r"\s*(.*?)\s+(\S+)\s+(\S+)\s+(\S+)\s*", line) for line in table if not line.startswith("(")]
    rows = {match[1]: match.groups()[1:] for match in parsed if match}
    assert list(rows) == ["schedule", "model call", "sample", "append tokens", "engine step", "collect outputs",
                          "post (route, pickle, write)", "total", "server: unpickle, decode"]  # fmt: skip
    for base, this, ratio in rows.values():
        assert float(base) > 0 and float(this) > 0 and float(ratio) > 0
    total = rows["total"]
    assert float(total[0]) >= float(rows["engine step"][0])


def test_a_base_that_is_not_a_checkout_is_refused(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(RuntimeError, match="did not start"):
        host_ab.main(["--base", str(tmp_path), "--batch", "2", "--chunks", "1", "--chunk", "1"])
