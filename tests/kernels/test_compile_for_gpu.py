"""Every kernel compiles for sm_90 (H100) on this GPU-less machine, without register spills."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
ROOT = Path(__file__).resolve().parents[2]


def _compile(script: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """Run a compile script of this checkout outside the interpreter (whose kernels cannot be compiled)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, str(script), *args], env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(not CUOBJDUMP.exists(), reason="triton's NVIDIA backend tools are not installed")
def test_kernels_compile_for_sm90_without_spills():
    result = _compile(Path(__file__).with_name("compile_for_sm90.py"))
    assert result.returncode == 0, result.stderr[-3000:]
    reports = [json.loads(line) for line in result.stdout.splitlines()]
    assert {r["kernel"] for r in reports} == _all_kernels(ROOT / "kernels")
    for report in reports:
        assert report["local"] == 0 and report["stack"] == 0, report
        assert report["registers"] <= REGISTER_LIMITS.get(report["kernel"], 128), report


@pytest.mark.skipif(not CUOBJDUMP.exists(), reason="triton's NVIDIA backend tools are not installed")
def test_sass_loops_counts_the_loop_of_a_token_walking_kernel():
    """``benchmarks/sass_loops.py`` finds the segment-state kernel's token loop and its 16 exp2 per token (one per
    state entry a thread holds: 4 channels x 4 entries)."""
    result = _compile(ROOT / "benchmarks" / "sass_loops.py", "_segment_state_kernel")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line for line in result.stdout.splitlines() if line.startswith("| _segment_state_kernel")]
    assert len(rows) == 1, result.stdout
    registers, instructions, loop = (cell.strip() for cell in rows[0].split("|")[3:6])
    assert 0 < int(registers) <= 128 and int(instructions) > 0
    length, mufu = re.fullmatch(r"(\d+) \((\d+), \d+, \d+\)", loop).groups()
    assert int(length) > 16 and int(mufu) >= 16


# The SSD output kernel holds a [64, 32] score tile and a [64, 64] accumulator at 4 warps (fp32 inputs: 168); the
# Mamba-1 prefill scan keeps a channel's state, A, and the next token's B and C in each thread (151).
# The varlen conv's 16 x 128 tiles at 4 warps (the fastest launch on an H200, benchmarks/conv_tune.py) need ~178
# in this compile, which gives its strides no alignment hints. The Mamba-1 decode stack's GEMVs multiply a
# 16384-element tile per loop step at 8 warps (64 products a thread; the fastest launch on an H200,
# benchmarks/decode_tune.py) and hold the first tile's weights from the kernel's start (EARLY_LOADS): at batch 1
# in_proj needs 167 registers with bf16 weights and 224 with fp32, out_proj 140 and 184. Its SSM kernel holds
# dt_proj's rows of its 64 channels (and A) from its start: 120 with bf16 weights, 152 with fp32.
# The persistent Mamba-1 stack runs all three at 8 warps in one kernel (209 registers with bf16 weights, 254 with
# fp32, at batch 1): at most 255, so that one program of 256 threads fits an SM's 64K registers, as its grid barrier
# needs (a program per SM, all resident).
REGISTER_LIMITS = {"_ssd_chunk_scan_kernel": 168, "_selective_scan_varlen_kernel": 168, "_conv_varlen_kernel": 184,
                   "_mamba_in_proj_kernel": 232, "_mamba_out_proj_kernel": 192, "_mamba_ssm_kernel": 160,
                   "_mamba_persistent_kernel": 255}
# The persistent Mamba-2 stack holds whichever phase's tiles are live at 4 warps (the stack's NUM_WARPS): 224 at
# batch 1 in bf16, 234 at 8 rows; one program per SM at most, so anything up to 255 fits.
REGISTER_LIMITS["_mamba2_persistent_kernel"] = 248


def _all_kernels(folder: Path) -> set[str]:
    """Names of every Triton kernel in the package (by convention ``_<name>_kernel``), so none goes uncompiled."""
    return {
        name
        for path in folder.rglob("*.py")
        for name in re.findall(r"^def (_\w+_kernel)\(", path.read_text(), flags=re.MULTILINE)
    }
