"""Fixtures: an in-process app (TestClient) and a live server on 127.0.0.1, both over random:mingru-tiny."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

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


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    with TestClient(create_app(tiny_config())) as test_client:
        yield test_client


@pytest.fixture(scope="module")
def live_url() -> Iterator[str]:
    """A real server (uvicorn, random free port) requiring API_KEY; stopped after the module."""
    with serve_in_thread(create_app(tiny_config(api_key=API_KEY, max_num_seqs=2))) as url:
        yield url
