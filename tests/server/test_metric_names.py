"""The exported names: docs/metrics.md lists exactly the series ``/metrics`` exports, they follow Prometheus'
naming rules (``promtool check metrics``) but for the deprecated alias kept for one release, and that alias
carries its replacement's value."""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch

from rnnserve.engine.llm_engine import EngineLoad
from rnnserve.engine.models.base import StateSpec
from rnnserve.engine.prefix_cache import TierUsage
from rnnserve.server.metrics import DEPRECATED_STATE_SLOTS, ServerMetrics
from rnnserve.server.sessions import SessionCodec, SessionStore

DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"
PROMTOOL = shutil.which("promtool")


def exposition() -> str:
    """A server's metrics page with a pool, both prefix-cache tiers and sessions (whose gauges are absent without
    them)."""
    metrics = ServerMetrics("m", 64)
    metrics.set_pool(num_slots=4, bytes_per_slot=8)
    metrics.set_load(EngineLoad(1, 0, 4, 1, 8, [TierUsage("device", 10, 20, 3), TierUsage("host", 1, 2, 1)]))
    with tempfile.TemporaryDirectory() as folder:
        codec = SessionCodec("ab" * 32, [StateSpec("h", (2,), torch.float32)], vocab_size=10)
        store = SessionStore(Path(folder), codec, 10, 1 << 20, 1 << 20, metrics=metrics.sessions)
        store.create()
        return metrics.render().decode()


def exported_names(text: str) -> set[str]:
    """The names of a page's ``# TYPE`` lines, without prometheus-client's ``_created`` series (which the docs
    mention, not list)."""
    return {name for name in re.findall(r"^# TYPE (\w+) ", text, re.M) if not name.endswith("_created")}


def documented_names() -> set[str]:
    """The series named in the first column of docs/metrics.md's tables."""
    cells = re.findall(r"^\| (`[^|]*) \|", DOC.read_text(), re.M)
    return {name for cell in cells for name in re.findall(r"`((?:rnnserve|process)_\w+)", cell)}


def test_the_docs_list_every_exported_series() -> None:
    assert documented_names() == exported_names(exposition())


def test_the_deprecated_slot_gauge_is_an_alias_of_the_new_one() -> None:
    text = exposition()
    assert "# TYPE rnnserve_state_slots gauge" in text and f"# TYPE {DEPRECATED_STATE_SLOTS} gauge" in text
    assert 'rnnserve_state_slots{model_name="m"} 4.0' in text
    assert f'{DEPRECATED_STATE_SLOTS}{{model_name="m"}} 4.0' in text
    assert re.search(rf"^\| `{DEPRECATED_STATE_SLOTS}` \| slots \| \*\*Deprecated\*\* alias", DOC.read_text(), re.M)


@pytest.mark.skipif(PROMTOOL is None, reason="needs promtool (Debian's prometheus package)")
def test_promtool_flags_only_the_deprecated_alias() -> None:
    done = subprocess.run(
        [PROMTOOL, "check", "metrics"], input=exposition(), capture_output=True, text=True, timeout=60
    )  # fmt: skip
    problems = (done.stdout + done.stderr).strip().splitlines()
    assert problems == [f'{DEPRECATED_STATE_SLOTS} non-counter metrics should not have "_total" suffix'], problems


def test_the_session_gauges_count_a_shared_folder_as_it_is() -> None:
    """With several API servers the scraped one reports the sessions the others stored too: each server sets the
    shared gauges (one prometheus-client value in multiprocess mode, one ``SessionMetrics`` here) after each change
    of the folder, to the count the servers keep under its write lock, and a scrape reads no folder."""
    with tempfile.TemporaryDirectory() as folder:
        codec = SessionCodec("ab" * 32, [StateSpec("h", (2,), torch.float32)], vocab_size=10)
        metrics = ServerMetrics("m", 64)
        scraped, other = (SessionStore(Path(folder), codec, 10, 1 << 20, 1 << 20, shared=True,
                                       metrics=metrics.sessions) for _ in range(2))  # fmt: skip
        first = scraped.create()
        other.create()
        other.create()
        other.delete(first.id)  # the deleting server counted the folder as it is: scraped's own count is stale
        text = metrics.render().decode()
        size = sum(path.stat().st_size for path in Path(folder).glob("*.safetensors"))
    assert 'rnnserve_sessions{model_name="m"} 2.0' in text
    assert f'rnnserve_session_bytes{{model_name="m"}} {float(size)}' in text
