"""The distribution installs the repository's folders under one ``rnnserve`` namespace."""

import subprocess
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = {"rnnserve.engine": "engine", "rnnserve.kernels": "kernels", "rnnserve.server": "server",
           "rnnserve.clients": "clients"}


def test_every_package_folder_is_listed() -> None:
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert setuptools["package-dir"] == {"rnnserve": "rnnserve", **FOLDERS}
    on_disk = {"rnnserve"}
    for package, folder in FOLDERS.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            relative = init.parent.relative_to(ROOT / folder).parts
            on_disk.add(".".join((package, *relative)))
    assert sorted(setuptools["packages"]) == sorted(on_disk)


def test_the_cpu_kernel_sources_are_package_data() -> None:
    """The CPU extension compiles on the user's machine from its sources and the headers they share."""
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    kernels = ROOT / "kernels"
    needed = {p.relative_to(kernels) for p in [*kernels.glob("*/*_cpu.cpp"), *kernels.glob("*.h")]}
    covered = {p.relative_to(kernels) for pattern in patterns["rnnserve.kernels"] for p in kernels.glob(pattern)}
    assert needed and needed <= covered


def test_no_generic_top_level_names_outside_the_checkout(tmp_path: Path) -> None:
    code = (
        "import importlib.util, rnnserve\n"
        "from rnnserve import LLM, SamplingParams\n"
        "print([n for n in ('engine', 'server', 'clients', 'kernels') if importlib.util.find_spec(n)])"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_gpu_wheels_cover_the_serving_stack() -> None:
    """``make gpu-wheels`` downloads each package of the serving stack by name (no dependency resolution): the
    list must hold every package fastapi, uvicorn, httptools and uvloop need on Python 3.12, as installed here."""
    from importlib import metadata

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    makefile = (ROOT / "Makefile").read_text().replace("\\\n", " ")
    listed = next(line for line in makefile.splitlines() if line.startswith("SERVING_STACK :="))
    stack = {canonicalize_name(name) for name in listed.split(":=", 1)[1].split()}
    environment = {"python_version": "3.12", "python_full_version": "3.12.0", "sys_platform": "linux",
                   "platform_system": "Linux", "extra": ""}  # fmt: skip
    needed: set[str] = set()
    todo = ["fastapi", "uvicorn", "httptools", "uvloop"]
    while todo:
        name = canonicalize_name(todo.pop())
        if name in needed:
            continue
        needed.add(name)
        for line in metadata.requires(name) or []:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate(environment):
                todo.append(requirement.name)
    assert needed <= stack, f"missing from SERVING_STACK: {sorted(needed - stack)}"


def _undeclared_imports(folders: list[str], requirements: list[str], *, module_level_only: bool) -> dict[str, str]:
    """The third-party top-level modules the Python files under ``folders`` import that no distribution named in
    ``requirements`` provides, each with one file importing it."""
    import ast
    from importlib import metadata

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    declared = {canonicalize_name(Requirement(r).name) for r in requirements}
    ours = {"rnnserve", "tests", "scripts", "benchmarks", *FOLDERS.values()}
    distributions = metadata.packages_distributions()
    undeclared = {}
    for path in sorted(p for folder in folders for p in (ROOT / folder).rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in tree.body if module_level_only else ast.walk(tree):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = [node.module]
            else:
                continue
            for top in {module.split(".")[0] for module in modules} - ours - set(sys.stdlib_module_names):
                names = {canonicalize_name(d) for d in distributions.get(top, [top])}
                if not names & declared:
                    undeclared.setdefault(top, str(path.relative_to(ROOT)))
    return undeclared


def test_the_tests_module_level_imports_are_declared() -> None:
    """Every third-party package a test module imports at its top is a runtime dependency or a test extra
    (one installed only as another package's dependency may go away with it; a package imported inside a test
    that skips without it need not be declared)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = [*project["dependencies"], *project["optional-dependencies"]["test"]]
    undeclared = _undeclared_imports(["tests"], requirements, module_level_only=True)
    assert not undeclared, f"imported by tests, not declared in pyproject.toml: {undeclared}"


def test_the_package_imports_are_declared() -> None:
    """Every third-party package the installed code imports, at module level or inside a function, is a runtime
    dependency or one of the optional extras (triton, client); not the test extra, which users do not install.
    A package that only arrives as another's dependency (starlette under fastapi) may change or go away with it."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = [r for name, group in project["optional-dependencies"].items() if name != "test" for r in group]
    undeclared = _undeclared_imports(["rnnserve", *FOLDERS.values()], [*project["dependencies"], *extras],
                                     module_level_only=False)  # fmt: skip
    assert not undeclared, f"imported by the rnnserve package, not declared in pyproject.toml: {undeclared}"
