"""The CPU kernels' builder: finds the ninja wheel's binary, builds once at start-up and logs the outcome."""

from __future__ import annotations

import logging
import os
import shutil

import pytest
import torch
from torch.utils import cpp_extension

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


def test_start_up_build_logs_the_ready_line(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    if os.environ.get("RNNSERVE_CPU_KERNELS", "1") == "0" or not (shutil.which("c++") or shutil.which("g++")):
        pytest.skip("fused CPU kernels disabled, or no C++ compiler")
    monkeypatch.setattr(cpu_extension, "_built", None)
    with caplog.at_level(logging.INFO, logger=cpu_extension.__name__):
        assert cpu_extension.build_cpu_extension()
    ops = cpu_extension.registered_ops()
    expected = {"causal_conv1d_update", "mamba_mixer_decode", "residual_rms_norm", "row_argmax", "selective_scan"}
    assert expected <= set(ops)
    assert f"fused CPU kernels ready ({len(ops)} ops) in " in caplog.text


def test_failed_build_names_the_fallback(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    def no_compiler(**_: object) -> None:
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(cpu_extension, "_built", None)
    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    with caplog.at_level(logging.INFO, logger=cpu_extension.__name__):
        assert not cpu_extension.build_cpu_extension()
        assert not cpu_extension.use_cpu_kernel(torch.zeros(1))  # decided once, not retried per call
    assert "fall back to their PyTorch paths" in caplog.text and "no C++ compiler" in caplog.text


def test_disabled_kernels_are_not_built(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    def must_not_build(**_: object) -> None:
        raise AssertionError("built although disabled")

    monkeypatch.setattr(cpu_extension, "_built", None)
    monkeypatch.setattr(cpp_extension, "load", must_not_build)
    monkeypatch.setenv("RNNSERVE_CPU_KERNELS", "0")
    with caplog.at_level(logging.INFO, logger=cpu_extension.__name__):
        assert not cpu_extension.build_cpu_extension()
    assert "RNNSERVE_CPU_KERNELS=0" in caplog.text


def test_a_build_on_first_use_is_logged(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Without the start-up build, the first op that asks builds the kernels, and says so."""
    monkeypatch.setattr(cpu_extension, "_built", None)
    monkeypatch.setenv("RNNSERVE_CPU_KERNELS", "0")
    with caplog.at_level(logging.WARNING, logger=cpu_extension.__name__):
        assert not cpu_extension.cpu_ops()
    assert "before build_cpu_extension()" in caplog.text
