"""What a session write costs in a shared session folder (``--api-servers`` > 1) of many sessions, against an
earlier revision of the code, 2026-11-30.

Before, every write, delete and expiry of a shared folder listed and stat'ed the whole folder under its write lock,
to count it: O(sessions) per change, and every API server's changes waited for it. Now a change moves the count
the folder's servers keep in its lease file by what it changed. This runs the same operations with this checkout's
code and with ``--baseline`` (a git revision, extracted with ``git archive``), each in a fresh process, alternating
``--rounds`` times, over one folder of ``--sessions`` session files: a turn's write (``save`` of an existing
session) and a ``create`` + ``delete`` pair, each timed ``--ops`` times (medians).

Usage: ``python benchmarks/session_writes.py [--sessions 10000] [--rounds 5] [--baseline a8a7b30]``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def fill(root: Path, folder: Path, count: int) -> None:
    """``count`` copies of one stored session, under new ids (written with the code at ``root``)."""
    sys.path.insert(0, str(root))
    import torch

    from rnnserve.engine.models.base import StateSpec
    from rnnserve.server.sessions import SessionCodec, SessionStore, new_session_id

    codec = SessionCodec("ab" * 32, [StateSpec("h", (64,), torch.float32)], vocab_size=256)
    store = SessionStore(folder, codec, count + 1, 1 << 40, 1 << 20)
    source = store.path(store.create().id)
    for _ in range(count - 1):
        shutil.copyfile(source, folder / f"{new_session_id()}.safetensors")


def measure(root: Path, folder: Path, ops: int) -> dict[str, float]:
    """In a fresh process: the median seconds of a save and of a create + delete, with the code at ``root``."""
    sys.path.insert(0, str(root))
    import torch

    from rnnserve.engine.models.base import StateSpec
    from rnnserve.engine.state_snapshot import StateSnapshot
    from rnnserve.server.sessions import SessionCodec, SessionStore

    specs = [StateSpec("h", (64,), torch.float32)]
    codec = SessionCodec("ab" * 32, specs, vocab_size=256)
    store = SessionStore(folder, codec, 1 << 30, 1 << 40, 1 << 20, shared=True)
    info = store.create()
    state = StateSnapshot({"h": torch.zeros(64)}, [1, 2, 3], [4])
    saves, pairs = [], []
    for _ in range(ops):
        start = time.perf_counter()
        store.save(info.id, state, info.created)
        saves.append(time.perf_counter() - start)
        start = time.perf_counter()
        store.delete(store.create().id)
        pairs.append(time.perf_counter() - start)
    store.delete(info.id)
    return {"save": statistics.median(saves), "create+delete": statistics.median(pairs)}


def extract(revision: str, into: Path) -> None:
    """The tree of ``revision`` of this repository, in ``into``."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", revision], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)


def run_worker(root: Path, folder: Path, ops: int) -> dict[str, float]:
    command = [sys.executable, __file__, "--worker", str(root), str(folder), "--ops", str(ops)]
    return json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--ops", type=int, default=50, help="operations of each kind timed per round")
    parser.add_argument("--baseline", default="a8a7b30", help="git revision measured as 'before'")
    parser.add_argument("--worker", nargs=2, metavar=("ROOT", "FOLDER"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(measure(Path(args.worker[0]), Path(args.worker[1]), args.ops)))
        return
    scratch = Path(tempfile.mkdtemp(prefix="rnnserve-writes-"))
    try:
        baseline, folder = scratch / "baseline", scratch / "sessions"
        baseline.mkdir()
        extract(args.baseline, baseline)
        fill(ROOT, folder, args.sessions)
        results: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
        for _ in range(args.rounds):
            results["before"].append(run_worker(baseline, folder, args.ops))
            results["after"].append(run_worker(ROOT, folder, args.ops))
        print(f"{args.sessions} session files, shared folder, {args.rounds} rounds x {args.ops} of each "
              f"(medians; before: {args.baseline})")  # fmt: skip
        medians = {
            side: {op: statistics.median(r[op] for r in rounds) * 1e3 for op in ("save", "create+delete")}
            for side, rounds in results.items()
        }
        for op in ("save", "create+delete"):
            before, after = medians["before"][op], medians["after"][op]
            print(f"  {op:14s} before {before:8.3f} ms   after {after:8.3f} ms   after / before {after / before:.3f}x")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
