"""The fused CPU kernels: one C++ extension built from every ``kernels/<op>/<op>_cpu.cpp``.

Each source registers its functions in the ``rnnserve`` operator namespace (``TORCH_LIBRARY_FRAGMENT``), so
callers reach them as ``torch.ops.rnnserve.<name>`` once the extension is loaded. The sources keep distinct
file names because PyTorch's extension builder names each object file after its source's base name.

Call :func:`build_cpu_extension` at start-up (the engine does): building needs a C++ compiler with OpenMP
(g++ on Linux), takes about a minute once and is cached by PyTorch's extension builder, so a cached start
takes a second or two. When it cannot be built, or when ``RNNSERVE_CPU_KERNELS=0``, every op falls back to
its PyTorch path. A process that never called it builds on the first op that asks (:func:`cpu_ops`), with a
warning: that first call then waits for the build.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path

import torch

from rnnserve.kernels.backend import use_triton

log = logging.getLogger(__name__)

NAMESPACE = "rnnserve"
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


def registered_ops() -> list[str]:
    """Names of the operators registered under ``torch.ops.rnnserve`` (empty before the extension loads)."""
    prefix = f"{NAMESPACE}::"
    return sorted(name[len(prefix) :] for name in torch._C._dispatch_get_all_op_names() if name.startswith(prefix))


def build_cpu_extension() -> bool:
    """Build (once per machine, cached) and load the fused CPU kernels; ``True`` when they are usable.

    Logs ``fused CPU kernels ready (N ops) in X s``, or a warning naming the PyTorch fallback. Later calls
    return the first call's answer at once.
    """
    global _built
    if _built is not None:
        return _built
    _built = False
    if os.environ.get("RNNSERVE_CPU_KERNELS", "1") == "0":
        log.info("fused CPU kernels disabled (RNNSERVE_CPU_KERNELS=0): CPU ops run their PyTorch paths")
        return False
    start = time.perf_counter()
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
    except Exception as err:  # no compiler, no OpenMP, read-only cache dir, ...
        log.warning("fused CPU kernels unavailable, CPU ops fall back to their PyTorch paths (slower): %s", err)
        return False
    _built = True
    log.info("fused CPU kernels ready (%d ops) in %.1f s", len(registered_ops()), time.perf_counter() - start)
    return True


def cpu_ops() -> bool:
    """``True`` when ``torch.ops.rnnserve`` holds the fused kernels; builds them on the first call if
    :func:`build_cpu_extension` has not run yet (with a warning, since the caller then waits for the build)."""
    if _built is None:
        log.warning("fused CPU kernels requested before build_cpu_extension(): building them now")
        return build_cpu_extension()
    return _built


def use_cpu_kernel(x: torch.Tensor) -> bool:
    """True when an op on ``x`` should run its fused CPU kernel (not while tests force the Triton kernels)."""
    return x.device.type == "cpu" and not use_triton(x) and cpu_ops()
