"""Every kernel compiles for sm_90 (H100) on this GPU-less machine, without register spills."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


@pytest.mark.skipif(not CUOBJDUMP.exists(), reason="triton's NVIDIA backend tools are not installed")
def test_kernels_compile_for_sm90_without_spills():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    root = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    script = Path(__file__).with_name("compile_for_sm90.py")
    result = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    reports = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(reports) == 22
    for report in reports:
        assert report["local"] == 0 and report["stack"] == 0, report
        assert report["registers"] <= 128, report
