"""The docs against the repository, for what can be checked without running anything: links between the docs (files
and heading anchors, as GitHub renders them) resolve, and every environment variable the code reads is documented
in docs/cli.md, and every ``random:`` preset in docs/models.md."""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

import pytest

from rnnserve.engine.loader import PRESETS

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", REPO / "CONTRIBUTING.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
# Read by the code, but documented by their owners, not here.
GENERAL_VARIABLES = {"PATH"}
# Where the shipped code reads the environment (benchmarks and tests read their own, documented beside them).
CODE_FOLDERS = ("engine", "server", "kernels", "clients", "rnnserve")


def prose(text: str) -> str:
    """``text`` without its fenced code blocks and code spans, where ``[x](y)`` and ``# x`` are not markdown."""
    return re.sub(r"`[^`\n]*`", "", re.sub(r"^```.*?^```", "", text, flags=re.M | re.S))


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation but ``-`` and ``_`` dropped, spaces to ``-``."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(doc: Path) -> set[str]:
    """The anchors of a doc's headings (a repeated one gets ``-1``, ``-2``, ... as on GitHub)."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    text = re.sub(r"^```.*?^```", "", doc.read_text(), flags=re.M | re.S)
    for heading in re.findall(r"^#{1,6} (.+)$", text, re.M):
        anchor = github_anchor(heading)
        count = seen.get(anchor, 0)
        seen[anchor] = count + 1
        found.add(anchor if count == 0 else f"{anchor}-{count}")
    return found


def local_links(doc: Path) -> list[str]:
    return [target for target in LINK.findall(prose(doc.read_text())) if not re.match(r"[a-z]+:", target)]


@pytest.mark.parametrize("doc", DOCS, ids=lambda doc: str(doc.relative_to(REPO)))
def test_links_resolve(doc: Path) -> None:
    broken = []
    for target in local_links(doc):
        path, _, anchor = target.partition("#")
        destination = (doc.parent / path).resolve() if path else doc
        if not destination.exists():
            broken.append(f"{target}: no such file")
        elif anchor and destination.suffix == ".md" and anchor not in anchors(destination):
            broken.append(f"{target}: {destination.name} has no heading with this anchor")
    assert not broken, f"{doc.name}: {broken}"


def test_anchors_follow_githubs_rules() -> None:
    heading = "Model names (`--model`, `LLM(model)`, `load_model`)"
    assert github_anchor(heading) == "model-names---model-llmmodel-load_model"
    heading = "Compose: from `docker compose up` to a dashboard"
    assert github_anchor(heading) == "compose-from-docker-compose-up-to-a-dashboard"


def variables_read() -> dict[str, set[str]]:
    """Each environment variable the shipped code names on a line that reads the environment (``os.environ``,
    ``getenv``, a ``..._ENV...`` constant), with the files."""
    found: dict[str, set[str]] = {}
    for folder in CODE_FOLDERS:
        for path in (REPO / folder).rglob("*.py"):
            for line in path.read_text().splitlines():
                if re.search(r"environ|getenv|_ENV\w* = ", line, re.I):
                    for name in re.findall(r"[\"']([A-Z][A-Z0-9_]{2,})[\"']", line):
                        found.setdefault(name, set()).add(str(path.relative_to(REPO)))
    return found


def documented_variables() -> set[str]:
    """The variables in the first column of docs/cli.md's "Environment variables" table."""
    section = (REPO / "docs" / "cli.md").read_text().split("## Environment variables", 1)[1].split("\n## ")[0]
    return {name for cell in re.findall(r"^\| (`[^|]*) \|", section, re.M) for name in re.findall(r"`(\w+)`", cell)}


def test_every_variable_the_code_reads_is_documented() -> None:
    read = variables_read()
    assert {"RNNSERVE_API_KEY", "GOMP_SPINCOUNT", "RNNSERVE_CPU_KERNELS"} <= set(read)  # the search finds them
    undocumented = set(read) - documented_variables() - GENERAL_VARIABLES
    assert not undocumented, f"docs/cli.md does not document {({name: sorted(read[name]) for name in undocumented})}"


def test_every_random_preset_is_named_in_models_md() -> None:
    """``--model random:<preset>`` takes each preset: docs/models.md names it (``mamba-130m``, ``random:...``, or a
    pattern such as ``*-tiny``)."""
    spans = {span.removeprefix("random:") for span in re.findall(r"`([^`\n]+)`", (REPO / "docs/models.md").read_text())}
    unnamed = sorted(name for name in PRESETS if not any(fnmatch.fnmatchcase(name, span) for span in spans))
    assert not unnamed, f"presets docs/models.md does not name: {unnamed}"
