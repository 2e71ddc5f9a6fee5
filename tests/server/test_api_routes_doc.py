"""docs/api.md's table of routes lists exactly the routes the app serves, with their methods."""

from __future__ import annotations

import re
from pathlib import Path

from fastapi.routing import APIRoute
from fastapi.testclient import TestClient
from starlette.routing import BaseRoute, Route

DOC = Path(__file__).resolve().parents[2] / "docs" / "api.md"
# Served, and not API routes: FastAPI's helper page of /docs, and the script of the /dashboard page.
UNLISTED = {("GET", "/docs/oauth2-redirect"), ("GET", "/dashboard/dashboard.js")}


def served_routes(routes: list[BaseRoute]) -> set[tuple[str, str]]:
    """(method, path) of every route, in included routers too; path parameters named ``{...}`` alike, and ``HEAD``
    left out (every ``GET`` answers it)."""
    found = set()
    for route in routes:
        if hasattr(route, "original_router"):  # FastAPI's wrapper of an included router
            found |= served_routes(route.original_router.routes)
        elif isinstance(route, APIRoute | Route):
            path = re.sub(r"\{[^}]*\}", "{...}", route.path)
            found |= {(method, path) for method in route.methods or () if method != "HEAD"}
    return found


def documented_routes() -> set[tuple[str, str]]:
    """(method, path) of every route in the first column of the doc's first table, queries left out."""
    table = DOC.read_text().split("| Route |", 1)[1].split("\n\n", 1)[0]
    cells = re.findall(r"^\| ([^|]+) \|", table, re.M)
    routes = {m.groups() for cell in cells for m in re.finditer(r"`(GET|POST|PUT|DELETE|PATCH) (/[^`?]*)", cell)}
    return {(method, re.sub(r"\{[^}]*\}", "{...}", path)) for method, path in routes}


def test_the_doc_lists_every_route(client: TestClient) -> None:
    served, documented = served_routes(client.app.routes) - UNLISTED, documented_routes()  # type: ignore[attr-defined]
    assert ("POST", "/v1/completions") in documented and ("GET", "/v1/sessions/{...}/state") in documented
    assert served == documented, f"undocumented {sorted(served - documented)}, not served {sorted(documented - served)}"
