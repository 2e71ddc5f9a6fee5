"""Fixtures: an in-process app (TestClient) and a live server on 127.0.0.1, both over random:mingru-tiny."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from rnnserve.engine.llm_engine import LLMEngine
from rnnserve.engine.sampling_params import StructuredOutputParams
from rnnserve.engine.structured_output import CompiledGrammar
from rnnserve.server.app import ServerConfig, create_app
from rnnserve.server.background import serve_in_thread

TINY = "random:mingru-tiny"
API_KEY = "test-secret-key"


def tiny_config(**overrides: object) -> ServerConfig:
    base: dict[str, object] = {
        "model": TINY,
        "max_num_seqs": 4,
        "max_prompt_tokens": 64,
        "max_body_bytes": 8192,
        "api_key": None,  # not $RNNSERVE_API_KEY from the developer's shell
    }
    return ServerConfig.build(**{**base, **overrides})


def hold_grammar_compiles(monkeypatch: pytest.MonkeyPatch, engine: LLMEngine, timeout: float) -> threading.Semaphore:
    """Make each of ``engine``'s grammar compiles wait for a release of the returned semaphore (at most
    ``timeout`` seconds, then the compile fails the test)."""
    may_finish = threading.Semaphore(0)
    real_compile = engine.grammars.compile

    def held_compile(constraint: StructuredOutputParams) -> CompiledGrammar:
        assert may_finish.acquire(timeout=timeout)
        return real_compile(constraint)

    monkeypatch.setattr(engine.grammars, "compile", held_compile)
    return may_finish


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    with TestClient(create_app(tiny_config())) as test_client:
        yield test_client


@pytest.fixture(scope="module")
def live_url() -> Iterator[str]:
    """A real server (uvicorn, random free port) requiring API_KEY; stopped after the module."""
    with serve_in_thread(create_app(tiny_config(api_key=API_KEY, max_num_seqs=2))) as url:
        yield url
