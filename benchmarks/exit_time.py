"""How long a serving process takes to end, by the way it ends: the interpreter's own exit after
``freeze_startup_heap`` (its atexit unfreezes the heap, then the teardown's collections go over all of it), that exit
with the heap left frozen, or with the collector disabled, and ``exit_process`` (atexit handlers, then ``os._exit``).

Each run is a fresh process that imports torch, loads the model as ``rnnserve serve`` does and freezes its heap,
then ends; the time is from its last line of Python to the parent seeing it gone. The ways alternate, and each
line reports its median and its ratio to the interpreter's exit of the same run. Also says whether the process wrote
a leak report (libtriton's nanobind lists its objects when the heap stays frozen through the teardown).

    python benchmarks/exit_time.py [--model MODEL] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CHILD = """
import atexit, gc, time
from rnnserve.engine.config import EngineConfig
from rnnserve.engine.llm_engine import LLMEngine, exit_process, freeze_startup_heap
import triton  # noqa: F401  (on a GPU the server has it loaded; its nanobind checks for leaks at exit)

engine = LLMEngine.from_config(EngineConfig(model={model!r}))
freeze_startup_heap()
way = {way!r}
if way == "frozen":
    atexit.unregister(gc.unfreeze)  # the heap stays frozen through the teardown
elif way == "disabled":
    gc.disable()
print(time.time(), flush=True)
if way == "exit_process":
    exit_process(0)
"""
WAYS = ["interpreter", "frozen", "disabled", "exit_process"]


def time_exit(way: str, model: str | None) -> tuple[float, bool]:
    """Seconds from the child's last line to its end, and whether it reported leaks."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD.format(model=model, way=way)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    assert child.stdout is not None
    ended_python = float(child.stdout.readline())
    _, err = child.communicate(timeout=300)
    ended = time.time()
    assert child.returncode == 0, err
    return ended - ended_python, "leaked" in err


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the embedded default model")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    times: dict[str, list[float]] = {way: [] for way in WAYS}
    leaks: dict[str, bool] = dict.fromkeys(WAYS, False)
    for _ in range(args.repeats):
        for way in WAYS:
            seconds, leaked = time_exit(way, args.model)
            times[way].append(seconds)
            leaks[way] |= leaked
    base = statistics.median(times["interpreter"])
    for way in WAYS:
        median = statistics.median(times[way])
        runs = " ".join(f"{t:.2f}" for t in times[way])
        print(f"{way:13s} median {median:6.3f} s  x{median / base:5.3f}  leak report: {leaks[way]!s:5s}  runs: {runs}")


if __name__ == "__main__":
    main()
