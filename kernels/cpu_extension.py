"""The fused CPU kernels: one C++ extension built from every ``kernels/<op>/<op>_cpu.cpp`` on first use.

Each source registers its functions in the ``rnnserve`` operator namespace (``TORCH_LIBRARY_FRAGMENT``), so
callers reach them as ``torch.ops.rnnserve.<name>`` once :func:`cpu_ops` has returned ``True``. Building
needs a C++ compiler with OpenMP (g++ on Linux) and takes about a minute once; the result is cached by
PyTorch's extension builder. When it cannot be built, or when ``RNNSERVE_CPU_KERNELS=0``, :func:`cpu_ops`
returns ``False`` and every op falls back to its PyTorch path.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCES = sorted(str(p) for p in Path(__file__).parent.glob("*/*_cpu.cpp"))  # plus the shared cpu_math.h
FLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-ffast-math", "-fopenmp"]

_built: bool | None = None


def ensure_ninja_on_path() -> None:
    """PyTorch's extension builder runs ``ninja`` from ``PATH``; when only the ``ninja`` wheel (a dependency)
    provides it, e.g. a venv used without being activated, put the wheel's directory on ``PATH``."""
    if shutil.which("ninja"):
        return
    try:
        import ninja
    except ImportError:
        return
    os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])


def cpu_ops() -> bool:
    """Build (once) and load the extension; ``True`` when ``torch.ops.rnnserve`` holds the fused kernels."""
    global _built
    if _built is not None:
        return _built
    _built = False
    if os.environ.get("RNNSERVE_CPU_KERNELS", "1") == "0":
        return False
    try:
        from torch.utils.cpp_extension import load

        ensure_ninja_on_path()
        load(
            name="rnnserve_cpu_kernels",
            sources=SOURCES,
            extra_cflags=FLAGS,
            extra_include_paths=[str(Path(__file__).parent)],
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
        )
        _built = True
    except Exception as err:  # no compiler, no OpenMP, read-only cache dir, ...
        log.warning("fused CPU kernels unavailable, using the PyTorch paths: %s", err)
    return _built


def use_cpu_kernel(x: torch.Tensor) -> bool:
    """True when an op on ``x`` should run its fused CPU kernel."""
    return x.device.type == "cpu" and cpu_ops()
