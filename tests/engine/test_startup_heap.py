"""``freeze_startup_heap``: after it, the live objects of many requests in flight no longer set off young
collections, and garbage cycles are still collected. Run in a fresh interpreter: it changes the collector of the
whole process."""

from __future__ import annotations

import json
import subprocess
import sys

SCRIPT = """
import gc, json
from rnnserve.engine.llm_engine import YOUNG_GENERATION_THRESHOLD, freeze_startup_heap

def churn():
    '''Requests come and go: 10,000 live objects at a time, replaced ten times over; how many collections ran.'''
    collections = []
    callback = lambda phase, info: phase == "start" and collections.append(info["generation"])
    gc.callbacks.append(callback)
    live = []
    for _ in range(10):
        live = [[i] for i in range(10_000)]
    gc.callbacks.remove(callback)
    return len(collections)

before = churn()
freeze_startup_heap()
after = churn()

class Node:
    pass

cycle = Node()
cycle.next = Node()
cycle.next.next = cycle
del cycle
print(json.dumps({"before": before, "after": after, "cycles": gc.collect(),
                  "threshold": gc.get_threshold()[0] == YOUNG_GENERATION_THRESHOLD, "frozen": gc.get_freeze_count()}))
"""


def test_young_collections_are_rare_after_the_startup_heap_is_frozen() -> None:
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, check=True)
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert figures["before"] > 50, figures  # Python's default threshold: a collection every 700 new objects
    assert figures["after"] == 0, figures
    assert figures["cycles"] >= 2 and figures["threshold"] and figures["frozen"] > 10_000, figures
