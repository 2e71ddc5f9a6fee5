"""Attacks on the HTTP surface that held up badly: a second ``Host`` header passed the Host check (the guard read the
last one); a field name is the client's text, so writing it to the log must not forge log lines (a newline in it)
nor fill the disk (a 1 MiB body of unknown fields became a 700 KB log line per request)."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from rnnserve.server.app import create_app
from tests.server.conftest import tiny_config

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    """A server with the default body limit (1 MiB), as ``rnnserve serve`` runs."""
    with TestClient(create_app(tiny_config(max_body_bytes=1 << 20))) as test_client:
        yield test_client


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_an_unknown_field_name_cannot_forge_a_log_line(client: TestClient, caplog: pytest.LogCaptureFixture) -> None:
    forged = "x\n2026-11-30 12:00:00,000 INFO rnnserve.server: admin logged in"
    with caplog.at_level(logging.WARNING, logger="rnnserve.server"):
        response = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1, forged: 1})
    assert response.status_code == 200
    (warning,) = warnings_of(caplog)
    assert "admin logged in" in warning  # still named, escaped
    assert not any(ch in warning for ch in "\n\r\x1b")


def test_the_unknown_fields_warning_is_bounded(client: TestClient, caplog: pytest.LogCaptureFixture) -> None:
    fields = {f"field_{i:06d}": 1 for i in range(50_000)}  # 900 KB, under --max-body-bytes
    body = json.dumps({"prompt": "Hi", "max_tokens": 1, **fields})
    with caplog.at_level(logging.WARNING, logger="rnnserve.server"):
        response = client.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == 200
    (warning,) = warnings_of(caplog)
    assert "field_000000" in warning and len(warning) < 4096


@pytest.mark.parametrize("hosts", [["evil.example", "localhost"], ["localhost", "localhost"]])
def test_a_request_with_two_host_headers_is_refused(client: TestClient, hosts: list[str]) -> None:
    """RFC 9112 (3.2): a 400. The guard kept the last Host, so ``Host: evil.example`` then ``Host: localhost`` passed
    its check, while a proxy or log in front of the server goes by the first."""
    headers = [("host", host) for host in hosts]
    response = client.get("/v1/models", headers=headers)
    assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_host"
    assert client.get("/v1/models", headers={"Host": "localhost"}).status_code == 200
