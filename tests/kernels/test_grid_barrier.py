"""``grid_barrier``, the persistent decode stacks' grid-wide barrier: its flow under the interpreter (one program:
the barrier passes at once), its memory order in the PTX an sm_90 compile emits (the interpreter has none)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from rnnserve.kernels.mamba_decode.fused_recurrent import grid_barrier  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


@triton.jit
def _rounds_kernel(x_ptr, counter_ptr, rounds):
    """Each round every program adds one to its neighbour's value (read through L2) and meets the others."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    for r in range(rounds):
        value = tl.load(x_ptr + (pid + 1) % programs, cache_modifier=".cg")
        tl.store(x_ptr + pid, value + 1)
        grid_barrier(counter_ptr, (r + 1) * programs)


def test_one_program_passes_each_barrier_once(triton_on_cpu):
    x = torch.zeros(1)
    counter = torch.zeros(1, dtype=torch.int32)
    _rounds_kernel[(1,)](x, counter, 7)
    assert x.item() == 7 and counter.item() == 7


PTX_SCRIPT = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from tests.kernels.test_grid_barrier import _rounds_kernel
source = ASTSource(_rounds_kernel, {"x_ptr": "*fp32", "counter_ptr": "*i32", "rounds": "i32"}, constexprs={})
print(triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8}).asm["ptx"])
"""


def test_sm90_arrival_is_a_release_and_the_wait_an_acquire_by_one_thread():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT.parent), str(ROOT), env.get("PYTHONPATH", "")])
    result = subprocess.run([sys.executable, "-c", PTX_SCRIPT], env=env, capture_output=True, text=True,
                            timeout=300, cwd=ROOT)
    if result.returncode != 0 and "ptxas" in result.stderr:
        pytest.skip("triton's NVIDIA backend tools are not installed")
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line.strip() for line in result.stdout.splitlines() if line.strip() and not line.strip().startswith(
        (".loc", "//", "mov.", "$L__tmp"))]
    arrivals = [line for line in lines if " red." in line or " atom." in line]
    waits = [line for line in lines if "ld.global" in line and "acquire" in line]
    assert len(arrivals) == 1 and arrivals[0].startswith("@") and "gpu.release.add" in arrivals[0], arrivals
    assert waits and all(line.startswith("@") and ".gpu.acquire" in line for line in waits), waits
    arrival = lines.index(arrivals[0])
    assert lines[arrival - 1].startswith("bar.sync"), lines[arrival - 3:arrival + 1]  # the stores come first
