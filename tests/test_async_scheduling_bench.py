"""``benchmarks/async_scheduling.py --free-model`` at a small size, in its own process (it sets torch's threads):
every offline and HTTP row is printed and no request fails; the rates themselves are not checked."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_free_model_rows_offline_and_over_http() -> None:
    command = [sys.executable, str(ROOT / "benchmarks" / "async_scheduling.py"), "--free-model", "--step-ms", "1",
               "--streams", "8", "--output-len", "8", "--rounds", "1"]  # fmt: skip
    out = subprocess.run(command, capture_output=True, text=True, check=True, timeout=300).stdout
    assert re.findall(r"^\| (off|on) \| \d+ \| \d+% \|$", out, re.MULTILINE) == ["off", "on"]
    http = re.findall(r"^\| (off|on) \| (off|on) \| \d+ \| \d+% \| \d+% \|", out, re.MULTILINE)
    assert http == [("off", "off"), ("on", "off"), ("on", "on")]
    assert re.findall(r"\((\d+) failed\)", out) == ["0", "0", "0"]
