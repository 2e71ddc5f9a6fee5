"""``retain_freed_memory``: after it, glibc keeps a large freed block for the next allocation instead of unmapping
it (so a prefill's activations do not fault their pages in again), and it leaves a malloc the environment tunes
alone. Run in fresh interpreters: it changes the allocator of the whole process."""

from __future__ import annotations

import gc
import json
import os
import platform
import subprocess
import sys

import pytest
import torch

from rnnserve.engine import LLM

SCRIPT = """
import json, sys
import torch
from rnnserve.engine.llm_engine import retain_freed_memory

def resident_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20

applied = retain_freed_memory() if sys.argv[1] == "retain" else None
block = torch.ones(64 * 2**20 // 4)  # 64 MB, touched
before = resident_mb()
del block
print(json.dumps({"applied": applied, "released_mb": before - resident_mb()}))
"""

glibc_linux = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's malloc on Linux"
)


def run(mode: str, **env: str) -> dict:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, check=True, env={**environ, **env}
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


@glibc_linux
def test_a_freed_block_stays_with_the_process() -> None:
    plain, retained = run("plain"), run("retain")
    assert plain["released_mb"] > 48  # malloc mapped the 64 MB block and unmapped it when freed
    assert retained["applied"] is True and retained["released_mb"] < 16  # kept for the next allocation


@glibc_linux
def test_a_malloc_the_environment_tunes_is_left_alone() -> None:
    tuned = run("retain", MALLOC_TRIM_THRESHOLD_="1000000")
    assert tuned["applied"] is False and tuned["released_mb"] > 48


def brk_heap() -> range:
    """The addresses of this process's brk heap (glibc's main arena)."""
    with open("/proc/self/maps") as maps:
        line = next(line for line in maps if line.rstrip().endswith("[heap]"))
    start, end = (int(address, 16) for address in line.split()[0].split("-"))
    return range(start, end)


@glibc_linux
def test_an_llm_built_in_the_test_process_leaves_its_malloc_and_collector_alone() -> None:
    """The suite's own process, which builds hundreds of engines, keeps glibc's malloc and the garbage collector as
    they were (tests/conftest.py): a large block is still a mapping of its own, not carved from the brk heap, which
    grew with every engine's prefix-cache tier until forking the test process failed; and no engine alive then is
    frozen out of the collector's reach."""
    frozen = gc.get_freeze_count()
    LLM("random:mingru-tiny", max_num_seqs=1)
    block = torch.empty(64 * 2**20 // 4)
    assert block.data_ptr() not in brk_heap()
    assert gc.get_freeze_count() == frozen
