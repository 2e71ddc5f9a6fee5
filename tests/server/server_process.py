"""Start ``rnnserve serve`` as a real process on a free port, for tests that need real sockets and signals."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    port: int
    log: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def output(self) -> str:
        return "".join(self.log)


@contextmanager
def running_server(
    *flags: str, env: dict[str, str] | None = None, timeout: float = 90.0, cwd: Path = REPO
) -> Iterator[ServerProcess]:
    """``rnnserve serve --port <free> FLAGS`` run in ``cwd`` (stdout and stderr collected in ``log``) until it logs
    that it is running; stopped with SIGINT when the block exits."""
    port = free_port()
    command = [sys.executable, "-m", "rnnserve.server.cli", "serve", "--port", str(port), *flags]
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    output = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}
    proc = subprocess.Popen(command, cwd=cwd, env=full_env, **output)  # type: ignore[call-overload]
    server = ServerProcess(proc, port)
    reader = threading.Thread(target=lambda: server.log.extend(proc.stdout), daemon=True)  # type: ignore[arg-type]
    reader.start()
    try:
        deadline = time.monotonic() + timeout
        while "Uvicorn running" not in server.output:
            assert proc.poll() is None and time.monotonic() < deadline, server.output
            time.sleep(0.1)
        yield server
    finally:
        stop(proc)
        reader.join(timeout=5)


def stop(proc: subprocess.Popen) -> None:
    """End a server that is still running, with SIGINT first: a process killed while it builds the CPU kernels
    leaves torch's build lock behind (the next build removes it: ``cpu_extension.exclusive_build``, with a
    warning)."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)
