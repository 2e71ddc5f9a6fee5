"""Several HTTP server processes in front of one engine process (``rnnserve serve --api-servers N``).

One Python process streams a few tens of thousands of SSE events a second and admits a few thousand requests a
second; a GPU decoding a few hundred streams produces more than that, and a wave of new requests waits for its
admissions one after the other. As vLLM's ``--api-server-count``, this runs N copies of the HTTP server, each
its own process with its own event loop and its own listening socket on the one port (``SO_REUSEPORT``: the kernel
spreads new connections evenly over those that listen, so none listens before all can) and all linked to the
one engine process by pipes of their own (:class:`~rnnserve.server.engine_core.ServerLinks` routes each
request's outputs to its server).

The process that runs them (:class:`APIServers`) only supervises: it loads the engine process, starts the servers,
forwards SIGTERM/SIGINT to them (each drains as a single server does), and stops everything when one of them or
the engine process dies, or a server stalls: the engine finds one that owes it something and makes no progress,
the supervisor one whose event loop stopped beating (an idle one too, whose connections would hang unnoticed).
Their metrics are shared through prometheus-client's multiprocess mode (see :mod:`rnnserve.server.metrics`), in a
folder it makes and removes; their session folder is shared (see :mod:`rnnserve.server.sessions`).
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, MutableSequence
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from multiprocessing.synchronize import Barrier
from types import FrameType

from rnnserve.engine.llm_engine import freeze_startup_heap
from rnnserve.server.config import MULTIPROCESS_DIR_ENV, ServerConfig
from rnnserve.server.engine_core import (
    EngineFactory,
    EngineInfo,
    EngineProcess,
    LoopLimits,
    ProcessDriver,
    receive_message,
    sigint_ignored,
)
from rnnserve.server.sessions import prepare_session_folder, session_dir

logger = logging.getLogger("rnnserve")
STOP_TIMEOUT = 30.0  # seconds the engine process gets to end once its servers stopped
READY_TIMEOUT = 300.0  # seconds an API server waits for its siblings to be ready before it gives up
HEARTBEAT_SECONDS = 1.0  # how often each API server's event loop beats, at most (see heartbeat_seconds)


def heartbeat_seconds(stall_timeout: float) -> float:
    """How often an API server's event loop beats: every second, or four times per ``stall_timeout`` if shorter."""
    return min(HEARTBEAT_SECONDS, stall_timeout / 4)


def run_api_server(
    config: ServerConfig,
    address: tuple[str, int],
    conn: Connection,
    info: EngineInfo,
    index: int,
    log_level: int,
    all_ready: Barrier,
    beats: MutableSequence[float] | None = None,
) -> None:
    """One API server process's main: serve ``config``'s app on a socket of its own bound to ``address`` (with
    ``SO_REUSEPORT``, as its siblings' are) with the engine behind ``conn``, listening once every party of
    ``all_ready`` (its siblings) is ready to. Connections made while only some listened would stay on those
    (clients keep them alive), and their load with them. Once it serves, its event loop writes the time
    (``time.monotonic``) into ``beats[index]`` every :func:`heartbeat_seconds`, when ``beats`` is given."""
    from rnnserve.server.app import create_app
    from rnnserve.server.http_server import build_server, listen_socket

    stop_with_parent()
    logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s %(name)s [api {index}]: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    sock = listen_socket(*address, reuse_port=True)
    app = create_app(config, driver=ProcessDriver(conn, info))
    freeze_startup_heap()
    try:
        all_ready.wait(READY_TIMEOUT)
    except threading.BrokenBarrierError:
        logger.error("the other API servers were not ready within %.0f s; not serving", READY_TIMEOUT)
        sys.exit(1)
    if beats is None:
        server = build_server(app, config)
    else:
        server = build_server(app, config, beating(beats, index), heartbeat_seconds(config.api_server_stall_timeout))
    server.run(sockets=[sock])


def beating(beats: MutableSequence[float], index: int) -> Callable[[], None]:
    """A heartbeat that writes the time into ``beats[index]``."""

    def heartbeat() -> None:
        beats[index] = time.monotonic()

    return heartbeat


PR_SET_PDEATHSIG = 1  # prctl(2)


def stop_with_parent() -> None:
    """Have the kernel send this process SIGTERM (a drain) when the launcher dies, however it dies (on Linux):
    killed, its API servers went on serving as orphans, holding the port a restart needs. The engine process
    ends by itself once its servers are gone."""
    prctl = getattr(ctypes.CDLL(None), "prctl", None)
    launcher = multiprocessing.parent_process()
    if prctl is None or launcher is None:
        return
    prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != launcher.pid:  # the launcher died before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)


class APIServers:
    """The engine process and ``config.api_servers`` server processes listening on the address ``sock`` is bound
    to (with ``SO_REUSEPORT``; ``sock`` itself never listens, it only holds the port); :meth:`wait` supervises
    them until they end. Construction blocks until the engine is loaded (and raises what loading raised)."""

    def __init__(self, config: ServerConfig, sock: socket.socket, factory: EngineFactory | None = None) -> None:
        log_level = logging.getLevelName(config.log_level.upper())
        self.metrics_dir = tempfile.mkdtemp(prefix="rnnserve-metrics-")
        os.environ[MULTIPROCESS_DIR_ENV] = self.metrics_dir  # read by each server process as it imports
        self.stopping = False
        try:
            self.engine = EngineProcess(
                config.engine, factory, log_level, config.api_servers, LoopLimits.of(config), report_stalls=True
            )
        except BaseException:
            self._remove_metrics_dir()
            raise
        if config.sessions:  # none of the servers may: one may be writing while another starts
            folder = session_dir(config, self.engine.info.model_fingerprint)
            try:
                prepare_session_folder(folder)
            except OSError as err:
                self.engine.close_links()
                self._remove_metrics_dir()
                raise ValueError(f"cannot use the session folder {folder}: {err.strerror or err}") from err
        context = multiprocessing.get_context("spawn")
        self.all_ready = context.Barrier(config.api_servers)  # kept: the servers unpickle it as they start
        # Each server's last heartbeat (0: none yet), shared memory its event loop writes (an aligned double:
        # no lock needed); watched when the stall timeout is set
        self.stall_timeout = config.api_server_stall_timeout
        self.beats = context.RawArray("d", config.api_servers) if self.stall_timeout else None
        self.servers: list[BaseProcess] = []
        # From now on a signal stops the servers (until wait returns). Ctrl-C reaches the whole process group:
        # the servers start with SIGINT ignored, and this process answers it with a SIGTERM to each, which
        # uvicorn turns into a drain once it runs (before, SIGTERM ends a server quietly).
        self._handlers = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        for index, conn in enumerate(self.engine.connections):
            server = context.Process(
                target=run_api_server,
                args=(config, sock.getsockname()[:2], conn, self.engine.info, index, log_level, self.all_ready,
                      self.beats),  # fmt: skip
                name=f"rnnserve-api-{index}",
                daemon=True,  # ended with this process, whatever ends it
            )
            if not self.stopping:
                with sigint_ignored():
                    server.start()
                self.servers.append(server)
            conn.close()  # the server process holds its end now; the engine sees EOF when that process ends

    @property
    def info(self) -> EngineInfo:
        return self.engine.info

    def stop(self) -> None:
        """Ask every server to drain and stop."""
        self.stopping = True
        for server in self.servers:
            if server.is_alive() and server.pid is not None:
                os.kill(server.pid, signal.SIGTERM)

    def wait(self) -> int:
        """Supervise until every server ended; 0 if they ended because :meth:`stop` asked, else 1 (a server or the
        engine process died, or a server stalled, which is killed; the others were stopped). Then wait for the
        engine process."""
        failed = False
        try:
            running = {server.sentinel: server for server in self.servers}
            engine: int | None = self.engine.process.sentinel
            stalls = self.engine.stalls
            look = heartbeat_seconds(self.stall_timeout) if self.beats is not None else None
            while running:
                waited = [*running, *([engine] if engine else []), *([stalls] if stalls else [])]
                ready = multiprocessing.connection.wait(waited, look)
                if self.beats is not None and not self.stopping and self._kill_silent():
                    failed = True
                for sentinel in ready:
                    if sentinel is stalls:
                        try:
                            self._kill_stalled(receive_message(stalls))
                        except (EOFError, OSError):  # the engine process ended
                            stalls = None
                        else:
                            failed = True
                        continue
                    if sentinel == engine:
                        engine = None
                        self.engine.process.join()
                        what = f"the engine process exited (exit code {self.engine.process.exitcode})"
                    else:
                        server = running.pop(sentinel)  # type: ignore[arg-type]
                        server.join()
                        what = f"{server.name} exited (exit code {server.exitcode})"
                    if not self.stopping:
                        logger.error("%s; stopping", what)
                        failed = True
                        self.stop()
        finally:
            for sig, handler in self._handlers.items():
                signal.signal(sig, handler)
        self.engine.join(STOP_TIMEOUT)
        self._remove_metrics_dir()
        return 1 if failed else 0

    def _kill_stalled(self, index: int) -> None:
        """The engine detached server ``index`` as stalled (its requests are aborted): kill it, since it can
        neither serve nor drain; its end stops the others, as a crash does."""
        self._kill(index, "the engine got no acknowledgement from it for --api-server-stall-timeout")

    def _kill_silent(self) -> bool:
        """Kill the servers whose event loop has not beaten for the stall timeout (idle ones too: the connections
        the kernel gives them would hang, and nothing else would notice); whether there were any."""
        assert self.beats is not None and self.stall_timeout
        now, killed = time.monotonic(), False
        for index, beat in enumerate(self.beats):
            if beat and now - beat >= self.stall_timeout:
                self._kill(index, f"its event loop did not run for {now - beat:.1f} s, --api-server-stall-timeout "
                                  f"{self.stall_timeout:g}")  # fmt: skip
                killed = True
        return killed

    def _kill(self, index: int, why: str) -> None:
        server = self.servers[index]
        if self.beats is not None:
            self.beats[index] = 0.0  # watched no more
        if server.is_alive() and server.pid is not None:
            logger.error("%s stalled (%s); killing it", server.name, why)
            os.kill(server.pid, signal.SIGKILL)

    def _on_signal(self, signum: int, _: FrameType | None) -> None:
        logger.info("%s: stopping %d API servers", signal.Signals(signum).name, len(self.servers))
        self.stop()

    def _remove_metrics_dir(self) -> None:
        shutil.rmtree(self.metrics_dir, ignore_errors=True)
        os.environ.pop(MULTIPROCESS_DIR_ENV, None)
