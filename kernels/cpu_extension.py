"""The fused CPU kernels: one C++ extension built from every ``kernels/<op>/<op>_cpu.cpp``.

Each source registers its functions in the ``rnnserve`` operator namespace (``TORCH_LIBRARY_FRAGMENT``), so
callers reach them as ``torch.ops.rnnserve.<name>`` once the extension is loaded. The sources keep distinct
file names because PyTorch's extension builder names each object file after its source's base name.

Call :func:`build_cpu_extension` at start-up (the engine does): building needs a C++ compiler with OpenMP
(g++ on Linux), takes about a minute once and is cached by PyTorch's extension builder, so a cached start
takes a second or two. When it cannot be built, or when ``RNNSERVE_CPU_KERNELS=0``, every op falls back to
its PyTorch path. A process that never called it builds on the first op that asks (:func:`cpu_ops`), with a
warning: that first call then waits for the build.

PyTorch's builder serialises builds with a lock file in the build directory that a process killed while it
builds (a server stopped with SIGKILL, out of memory) leaves behind, and every later build then waits on it
forever. Builds here first take an ``flock`` beside it, which the system releases with the process that held
it: under that lock no other build of ours is running, so a lock file found is stale and removed.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from rnnserve.kernels.backend import use_triton

try:
    import fcntl
except ImportError:  # Windows: PyTorch's lock file alone
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger(__name__)

NAMESPACE = "rnnserve"
EXTENSION = "rnnserve_cpu_kernels"
SOURCES = sorted(str(p) for p in Path(__file__).parent.glob("*/*_cpu.cpp"))  # plus the shared headers (*.h)
FLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-ffast-math", "-fopenmp"]

_built: bool | None = None
_name: str | None = None


def extension_name() -> str:
    """The extension's name on this CPU. ``-march=native`` compiles for the CPU that builds, and PyTorch's builder
    loads a cached build on any machine sharing its cache (a container image built elsewhere, a home directory
    on a network share), where a CPU without those instructions dies of SIGILL. The name carries a hash of the
    target the compiler resolves ``native`` to (else of the CPU's flags), so another kind of CPU builds its own."""
    global _name
    if _name is None:
        try:
            target = subprocess.run([os.environ.get("CXX", "c++"), "-march=native", "-Q", "--help=target"],
                                    capture_output=True, text=True, timeout=60, check=True).stdout  # fmt: skip
        except (OSError, subprocess.SubprocessError):  # no compiler (the build will say so), or not GCC's flags
            target = cpu_flags()
        _name = f"{EXTENSION}_{hashlib.sha256(target.encode()).hexdigest()[:12]}"
    return _name


def cpu_flags() -> str:
    """The first ``flags`` line of ``/proc/cpuinfo`` (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next((line for line in cpuinfo if line.startswith("flags")), "")
    except OSError:
        return ""


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


@contextlib.contextmanager
def exclusive_build(directory: Path) -> Iterator[None]:
    """Hold ``directory/rnnserve-build.flock`` (waiting for another process's build) for a build in
    ``directory``; remove PyTorch's lock file there if one was left (see the module docstring). Without
    ``fcntl`` (Windows) only PyTorch's lock file serialises builds."""
    if fcntl is None:
        yield
        return
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "rnnserve-build.flock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        stale = directory / "lock"
        if stale.exists():
            log.warning("removing %s, left by a build whose process was killed", stale)
            stale.unlink(missing_ok=True)
        yield  # the lock goes with the file's closing, or with the process


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
        from torch.utils.cpp_extension import _get_build_directory, load

        ensure_ninja_on_path()
        name = extension_name()
        with exclusive_build(Path(_get_build_directory(name, verbose=False))):
            load(
                name=name,
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
    return x.is_cpu and not use_triton(x) and cpu_ops()
