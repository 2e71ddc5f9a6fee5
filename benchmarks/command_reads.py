"""The engine process's read of one API server's commands: the blocking ``recv_bytes`` it used against the
``Inbox`` that reads without blocking, in one process, alternating.

A server end writes a command batch as ``CommandSender`` does (one ``send_bytes``); the engine end reads it
whole and unpickles it, ``--reads`` times per round, for a batch of one ``HandledCommand`` (what a streaming
server sends most) and one of four adds with prompts of 1,200 characters. Printed: the median time of a read in
each arm (wall clock, the write excluded) and their ratio.

    python benchmarks/command_reads.py [--rounds 15] [--reads 3000]
"""

from __future__ import annotations

import argparse
import functools
import multiprocessing
import os
import pickle
import socket
import statistics
import sys
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rnnserve.engine.sampling_params import SamplingParams
from rnnserve.server.engine_core import AddCommand, HandledCommand, Inbox, receive_message

BATCHES: dict[str, list] = {
    "handled": [HandledCommand()],
    "4 adds": [AddCommand(i, [f"cmpl-{i}"], ["hello " * 200], SamplingParams(max_tokens=16), 0.0) for i in range(4)],
}


def nanoseconds_per_read(server: Connection, read: Callable[[], object], payload: bytes, reads: int) -> float:
    total = 0
    for _ in range(reads):
        server.send_bytes(payload)
        start = time.perf_counter_ns()
        read()
        total += time.perf_counter_ns() - start
    return total / reads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--reads", type=int, default=3000)
    args = parser.parse_args()
    for name, batch in BATCHES.items():
        payload = pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL)
        server, engine = multiprocessing.Pipe()
        inbox = Inbox(socket.socket(fileno=os.dup(engine.fileno())))
        arms: dict[str, Callable[[], object]] = {
            "recv_bytes": functools.partial(receive_message, engine),  # what the engine used
            "Inbox": inbox.read,
        }
        times: dict[str, list[float]] = {arm: [] for arm in arms}
        for _ in range(args.rounds):
            for arm, read in arms.items():
                times[arm].append(nanoseconds_per_read(server, read, payload, args.reads))
        before, after = (statistics.median(times[arm]) for arm in arms)
        print(f"{name:>8} ({len(payload)} B): recv_bytes {before:7.0f} ns, Inbox {after:7.0f} ns, "
              f"Inbox/recv_bytes {after / before:.2f}")  # fmt: skip
        inbox.socket.close()
        server.close()
        engine.close()


if __name__ == "__main__":
    main()
