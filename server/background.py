"""Run an app on a real socket in a background thread (tests, notebooks, embedding)::

with serve_in_thread(create_app(ServerConfig.build(model="random:mingru-tiny"))) as url:
    httpx.get(f"{url}/health")
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn
from fastapi import FastAPI

from rnnserve.server.http_server import listen_socket


@contextmanager
def serve_in_thread(
    app: FastAPI, host: str = "127.0.0.1", port: int = 0, timeout: float = 60.0, http: str = "auto", loop: str = "auto"
) -> Iterator[str]:
    """Serve ``app`` on ``host:port`` (0 = a free port) until the block exits; yields the base URL. ``http``
    (auto, httptools, h11) and ``loop`` (auto, uvloop, asyncio) pick uvicorn's implementations."""
    sock = listen_socket(host, port)
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5, http=http, loop=loop)
    server = uvicorn.Server(config)
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [sock]}, name="rnnserve-http", daemon=True
    )
    thread.start()
    try:
        deadline = time.monotonic() + timeout
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        yield f"http://{host}:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout)
        sock.close()
