"""The CPU kernels' builder: finds the ninja wheel's binary, builds once at start-up and logs the outcome, and a
build killed midway does not hang the builds after it."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

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

    monkeypatch.delenv("RNNSERVE_CPU_KERNELS", raising=False)  # the suite may run with the kernels switched off
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


def test_a_lock_file_left_by_a_killed_build_is_removed(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "lock").write_text("")  # what PyTorch's builder leaves when its process is killed mid-build
    with caplog.at_level(logging.WARNING, logger=cpu_extension.__name__), cpu_extension.exclusive_build(tmp_path):
        assert not (tmp_path / "lock").exists()
    assert "left by a build whose process was killed" in caplog.text


def test_the_build_lock_goes_with_a_killed_process(tmp_path: Path) -> None:
    """A build waits for another process's build, and no longer once that process is killed (SIGKILL: no
    clean-up of its own runs)."""
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pathlib import Path; "
         "from rnnserve.kernels.cpu_extension import exclusive_build\n"
         "with exclusive_build(Path(sys.argv[1])):\n    print('held', flush=True); time.sleep(60)", str(tmp_path)],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])},
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        entered = threading.Event()

        def build() -> None:
            with cpu_extension.exclusive_build(tmp_path):
                entered.set()

        waiter = threading.Thread(target=build, daemon=True)
        waiter.start()
        assert not entered.wait(0.5)  # the other process builds
        holder.send_signal(signal.SIGKILL)
        assert entered.wait(10)
    finally:
        holder.kill()
        holder.wait()


def test_the_extension_is_named_after_the_cpu_it_is_compiled_for(monkeypatch: pytest.MonkeyPatch) -> None:
    """-march=native binaries cached under one name ran on any CPU sharing the cache (an image built on an
    AVX-512 machine died of SIGILL on an AVX2 node): the name now hashes the target native resolves to."""
    targets = iter(["-march= znver5\n-mavx512f [enabled]\n", "-march= haswell\n-mavx512f [disabled]\n"])

    def compiler(args: list[str], **kwargs: object) -> subprocess.CompletedProcess:
        assert args[1:] == ["-march=native", "-Q", "--help=target"]
        return subprocess.CompletedProcess(args, 0, next(targets), "")

    monkeypatch.setattr(cpu_extension.subprocess, "run", compiler)
    names = []
    for _ in range(2):
        monkeypatch.setattr(cpu_extension, "_name", None)
        names.append(cpu_extension.extension_name())
    assert names[0] != names[1] and all(n.startswith(cpu_extension.EXTENSION + "_") for n in names)
    assert cpu_extension.extension_name() == names[1]  # asked once a process

    def no_compiler(args: list[str], **kwargs: object) -> subprocess.CompletedProcess:
        raise FileNotFoundError(args[0])

    monkeypatch.setattr(cpu_extension.subprocess, "run", no_compiler)
    monkeypatch.setattr(cpu_extension, "_name", None)
    monkeypatch.setattr(cpu_extension, "cpu_flags", lambda: "flags : fpu avx2")
    assert cpu_extension.extension_name() not in names
