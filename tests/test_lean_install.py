"""`make serve` installs the runtime dependencies only: the server must import and serve on CPU without the
test extras (triton, transformers, openai, pytest, ruff). A subprocess hides them as if not installed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TEST_EXTRAS = ("triton", "transformers", "openai", "pytest", "_pytest", "ruff")

SERVE_WITHOUT_EXTRAS = f"""
import sys
for name in {TEST_EXTRAS!r}:
    sys.modules[name] = None  # `import name` raises ImportError and find_spec(name) is None: not installed

from fastapi.testclient import TestClient

from rnnserve.kernels.backend import HAS_TRITON
from rnnserve.server.app import ServerConfig, create_app
from rnnserve.server.cli import build_parser

assert not HAS_TRITON
build_parser()
app = create_app(ServerConfig.build(model="random:mingru-tiny", max_num_seqs=2, api_key=None))
with TestClient(app) as client:
    assert client.get("/ready").json() == {{"status": "ready"}}
    body = {{"prompt": "Hello", "max_tokens": 4, "ignore_eos": True, "temperature": 0}}
    completion = client.post("/v1/completions", json=body).json()
    assert completion["usage"]["completion_tokens"] == 4, completion
    chat = {{"messages": [{{"role": "user", "content": "Hi"}}], "max_tokens": 3, "stream": True}}
    assert client.post("/v1/chat/completions", json=chat).text.rstrip().endswith("data: [DONE]")
    assert "rnnserve_generation_tokens_total" in client.get("/metrics").text
hidden = [name for name in {TEST_EXTRAS!r} if sys.modules.get(name) is not None]
assert not hidden, hidden
print("served without test extras")
"""


def test_server_serves_on_cpu_without_the_test_extras() -> None:
    result = subprocess.run(
        [sys.executable, "-c", SERVE_WITHOUT_EXTRAS], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0 and "served without test extras" in result.stdout, result.stderr[-3000:]


def test_runtime_dependencies_leave_the_test_extras_out() -> None:
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    runtime = {dep.split(">")[0].split("=")[0].split(";")[0].strip().lower() for dep in project["dependencies"]}
    assert runtime.isdisjoint(TEST_EXTRAS)
    test_extras = " ".join(project["optional-dependencies"]["test"])
    assert all(name in test_extras for name in ("pytest", "triton", "transformers", "ruff"))
