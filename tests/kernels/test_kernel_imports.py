"""The kernels are a layer below the engine: each package imports on its own, in a fresh interpreter, without
importing any engine module (an import of the engine from a kernel's reference once made a cycle that only
importing the engine first hid)."""

from __future__ import annotations

import subprocess
import sys

CODE = """
import importlib, pkgutil, sys
import rnnserve.kernels as kernels
names = sorted(m.name for m in pkgutil.iter_modules(kernels.__path__))
for name in names:
    importlib.import_module(f"rnnserve.kernels.{name}")
print(len(names), sorted(n for n in sys.modules if n.startswith("rnnserve.engine")))
"""


def test_every_kernel_package_imports_without_the_engine() -> None:
    result = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    count, engine_modules = result.stdout.split(" ", 1)
    assert int(count) >= 20 and engine_modules.strip() == "[]", result.stdout
