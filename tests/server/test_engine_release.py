"""An app lets go of its in-process engine when its server stops, or when building it fails after the engine was
loaded. FastAPI keeps each app's endpoint callables in process-wide caches (thousands of entries), and through the
routes' closures the app: an engine the app still held stayed alive long after its server, with its weights,
state pool and prefix-cache tier (1 GiB of address space on the CPU), one per app built in the process. An app
whose chat template did not compile left its engine thread waiting for work, holding the engine it had loaded."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from rnnserve.engine.config import EngineConfig
from rnnserve.engine.llm_engine import LLMEngine
from rnnserve.server.app import create_app
from rnnserve.server.background import serve_in_thread
from tests.server.conftest import tiny_config


def test_a_stopped_app_holds_no_engine() -> None:
    app = create_app(tiny_config())  # kept alive here, as FastAPI's caches keep it
    engine = weakref.ref(app.state.engine.engine)
    with TestClient(app) as client:
        assert client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2}).status_code == 200
    gc.collect()
    assert engine() is None
    assert app.state.engine.engine is None and app.state.engine.driver.engine is None


def test_an_app_served_in_a_thread_holds_no_engine_once_stopped() -> None:
    app = create_app(tiny_config())
    engine = weakref.ref(app.state.engine.engine)
    with serve_in_thread(app) as url:
        assert httpx.post(f"{url}/v1/completions", json={"prompt": "a", "max_tokens": 2}).status_code == 200
    gc.collect()
    assert engine() is None


def test_an_app_that_fails_to_build_lets_go_of_the_engine_it_loaded(tmp_path: Path) -> None:
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}")
    built: list[weakref.ref[LLMEngine]] = []

    def recorded(config: EngineConfig) -> LLMEngine:
        engine = LLMEngine.from_config(config)
        built.append(weakref.ref(engine))
        return engine

    with pytest.raises(ValueError, match="does not compile"):
        create_app(tiny_config(chat_template=str(broken)), engine_factory=recorded)
    gc.collect()
    assert len(built) == 1 and built[0]() is None
