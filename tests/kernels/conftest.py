"""Kernel-test fixture: force the Triton kernels on CPU tensors through the interpreter."""

from __future__ import annotations

import os

import pytest

from rnnserve.kernels.backend import HAS_TRITON, force_triton


@pytest.fixture
def triton_on_cpu():
    """Run the Triton kernels on CPU tensors through the interpreter (skips if that is unavailable)."""
    if not HAS_TRITON or os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs triton and TRITON_INTERPRET=1")
    with force_triton(True):
        yield
