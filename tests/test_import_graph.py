"""The package's imports form no cycle, not even through imports deferred into functions (a cycle makes import
order matter and hides layering). Imports under ``if TYPE_CHECKING:`` are not run and do not count."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("engine", "kernels", "server", "clients")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(("rnnserve", *(parts[:-1] if parts[-1] == "__init__" else parts)))


def imports(path: Path, modules: set[str]) -> set[str]:
    """Project modules that ``path`` imports anywhere outside ``if TYPE_CHECKING:`` blocks."""
    tree = ast.parse(path.read_text())
    type_only = {
        id(n) for block in ast.walk(tree)
        if isinstance(block, ast.If) and ast.unparse(block.test) == "TYPE_CHECKING"
        for stmt in block.body for n in ast.walk(stmt)
    }
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:  # a submodule, else a name of the module
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                     for a in node.names]
        else:
            continue
        found.update(n for n in names if n in modules)
    return found


def test_no_import_cycles() -> None:
    files = {module_name(p): p for folder in FOLDERS for p in (ROOT / folder).rglob("*.py")}
    graph = {name: imports(path, set(files)) for name, path in files.items()}
    state: dict[str, str] = {}

    def visit(name: str, trail: list[str]) -> None:
        state[name] = "open"
        for dep in sorted(graph[name]):
            if dep == name:
                continue
            assert state.get(dep) != "open", "import cycle: " + " -> ".join([*trail, name, dep])
            if dep not in state:
                visit(dep, [*trail, name])
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [])
