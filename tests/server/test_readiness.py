"""Readiness (/ready, /health?ready), /version and `rnnserve --version`, and the port check before loading."""

from __future__ import annotations

import importlib.metadata
import logging
import socket

import httpx
import pytest
from fastapi.testclient import TestClient

from rnnserve.engine.llm_engine import LLMEngine
from rnnserve.server import cli
from rnnserve.server.app import create_app
from tests.server.conftest import TINY, tiny_config
from tests.server.server_process import running_server

VERSION = importlib.metadata.version("rnnserve")


def test_ready_only_while_the_engine_takes_requests() -> None:
    app = create_app(tiny_config())
    before = TestClient(app)  # no lifespan yet: the engine thread has not started
    assert before.get("/ready").status_code == 503
    assert before.get("/ready").json()["error"]["message"] == "the engine is not running"
    with TestClient(app) as client:
        assert client.get("/ready").json() == {"status": "ready"}
        assert client.get("/health?ready").json() == {"status": "ready"}
        app.state.engine.draining = True  # what a SIGTERM starts: the drain
        assert client.get("/ready").status_code == 503
        assert client.get("/health?ready").json()["error"]["message"] == "the server is shutting down"
        assert client.get("/health").json() == {"status": "ok"}  # alive while it drains
    assert before.get("/ready").status_code == 503  # stopped


def test_version_route_and_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with TestClient(create_app(tiny_config(api_key="k"))) as client:
        assert client.get("/version").json() == {"version": VERSION}  # open, like /health
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0 and capsys.readouterr().out.strip() == f"rnnserve {VERSION}"


def test_busy_port_fails_before_the_model_loads(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def never(*args: object) -> LLMEngine:
        raise AssertionError("the model must not load when the port is taken")

    monkeypatch.setattr(LLMEngine, "from_config", never)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with caplog.at_level(logging.ERROR, logger="rnnserve"):
            assert cli.main(["serve", "--model", TINY, "--port", str(port)]) == 1
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in caplog.text


def test_real_server_logs_loading_and_is_ready_once_listening() -> None:
    with running_server("--model", TINY) as server:
        assert httpx.get(f"{server.url}/ready", timeout=10).json() == {"status": "ready"}
        assert httpx.get(f"{server.url}/version", timeout=10).json() == {"version": VERSION}
    log = server.output
    assert log.index(f"rnnserve {VERSION}: loading model {TINY}") < log.index("model loaded in") < log.index(
        "Uvicorn running"
    )
