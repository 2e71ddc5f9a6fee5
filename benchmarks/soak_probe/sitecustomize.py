"""The soak's opt-in probe (``benchmarks/soak.py --probe-dir DIR``), loaded by every Python process of the server
through ``PYTHONPATH``: every ``$SOAK_PROBE_EVERY`` seconds a thread of each process appends its objects counted by
type (``gc.get_objects``: live objects and garbage cycles not collected yet) to ``DIR/gc-<pid>.jsonl`` and, with
``$SOAK_PROBE_TRACEMALLOC=1`` (tracing from start-up, one frame), dumps a tracemalloc snapshot to
``DIR/tm-<pid>-<n>.snap``. Nothing of it runs in a server started without the probe."""

from __future__ import annotations

import os

PROBE_DIR = os.environ.get("SOAK_PROBE_DIR")


def probe(directory: str, every: float) -> None:
    """Count objects (and snapshot the traced memory) every ``every`` seconds, forever."""
    import collections
    import gc
    import json
    import time
    import tracemalloc

    start = time.monotonic()
    for n in range(1, 1 << 30):
        time.sleep(every)
        counts = collections.Counter(type(o).__qualname__ for o in gc.get_objects())
        with open(os.path.join(directory, f"gc-{os.getpid()}.jsonl"), "a") as f:
            row = {"t": time.monotonic() - start, "n": n, "total": counts.total(),
                   "types": dict(counts.most_common(400))}  # fmt: skip
            f.write(json.dumps(row) + "\n")
        if tracemalloc.is_tracing():
            tracemalloc.take_snapshot().dump(os.path.join(directory, f"tm-{os.getpid()}-{n:03d}.snap"))


if PROBE_DIR:
    import threading
    import tracemalloc

    if os.environ.get("SOAK_PROBE_TRACEMALLOC") == "1":
        tracemalloc.start()
    every = float(os.environ.get("SOAK_PROBE_EVERY", "150"))
    threading.Thread(target=probe, args=(PROBE_DIR, every), name="soak-probe", daemon=True).start()
