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


def test_no_generic_top_level_names_outside_the_checkout(tmp_path: Path) -> None:
    code = (
        "import importlib.util, rnnserve\n"
        "from rnnserve import LLM, SamplingParams\n"
        "print([n for n in ('engine', 'server', 'clients', 'kernels') if importlib.util.find_spec(n)])"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
