"""The CPU kernels' builder finds the ninja wheel's binary when ninja is not on PATH."""

from __future__ import annotations

import os
import shutil

import pytest

from rnnserve.kernels import cpu_extension


def test_ninja_wheel_directory_goes_on_path(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    ninja = pytest.importorskip("ninja")
    monkeypatch.setenv("PATH", str(tmp_path))
    assert shutil.which("ninja") is None
    cpu_extension.ensure_ninja_on_path()
    assert os.environ["PATH"].split(os.pathsep)[0] == ninja.BIN_DIR
    assert shutil.which("ninja") is not None


def test_path_left_alone_when_ninja_is_found(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    (tmp_path / "ninja").write_text("#!/bin/sh\n")
    (tmp_path / "ninja").chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    cpu_extension.ensure_ninja_on_path()
    assert os.environ["PATH"] == str(tmp_path)


def test_kernels_build_where_a_compiler_exists() -> None:
    """A broken kernel source must fail the suite, not quietly skip every fused-kernel test."""
    if os.environ.get("RNNSERVE_CPU_KERNELS", "1") == "0" or not (shutil.which("c++") or shutil.which("g++")):
        pytest.skip("fused CPU kernels disabled, or no C++ compiler")
    assert cpu_extension.cpu_ops(), "the fused CPU kernels failed to build (see the warning logged above)"
