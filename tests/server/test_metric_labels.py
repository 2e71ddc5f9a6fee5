"""The labels of the exported series are those docs/metrics.md gives them: ``model_name`` on every ``rnnserve_*``
series, plus the one the table writes after a name (``{tier}``), none on ``process_*``."""

from __future__ import annotations

import re

from tests.server.test_metric_names import DOC, exposition


def documented_labels() -> dict[str, set[str]]:
    """Each series of the doc's tables with the labels the doc gives it."""
    cells = re.findall(r"^\| (`[^|]*) \|", DOC.read_text(), re.M)
    named = [match for cell in cells for match in re.findall(r"`((?:rnnserve|process)_\w+)(?:\{(\w+)\})?`", cell)]
    return {name: ({"model_name"} if name.startswith("rnnserve_") else set()) | ({label} if label else set())
            for name, label in named}  # fmt: skip


def exported_labels(text: str) -> dict[str, set[str]]:
    """Each series of a metrics page (histograms by their name, without ``_created``) with its samples' labels
    (``le`` aside)."""
    kinds = dict(re.findall(r"^# TYPE (\w+) (\w+)", text, re.M))
    labels: dict[str, set[str]] = {}
    for name, pairs in re.findall(r"^(\w+)(?:\{([^}]*)\})? ", text, re.M):
        base = re.sub(r"_(bucket|sum|count)$", "", name)
        series = base if kinds.get(base) == "histogram" else name
        if series in kinds and not series.endswith("_created"):
            labels.setdefault(series, set()).update(set(re.findall(r"(\w+)=", pairs)) - {"le"})
    return labels


def test_every_series_has_the_documented_labels() -> None:
    documented, exported = documented_labels(), exported_labels(exposition())
    assert documented["rnnserve_request_success_total"] == {"model_name", "finished_reason"}
    assert set(exported) == set(documented)
    wrong = {name: (sorted(documented[name]), sorted(labels)) for name, labels in exported.items()
             if name in documented and labels != documented[name]}  # fmt: skip
    assert not wrong, f"(documented, exported) labels differ: {wrong}"
