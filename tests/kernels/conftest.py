"""Kernel-test fixture: force the Triton kernels on CPU tensors through the interpreter."""

from __future__ import annotations

import os

import pytest

from rnnserve.kernels.backend import HAS_TRITON, force_triton


@pytest.fixture
def triton_on_cpu():
    """Run the Triton kernels on CPU tensors through the interpreter (skips if that is unavailable), its bf16
    ``tl.dot`` and integer -> bf16 casts computed as a GPU computes them (``tests/kernels/interpreter_bf16.py``)."""
    if not HAS_TRITON or os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs triton and TRITON_INTERPRET=1")
    from tests.kernels.interpreter_bf16 import gpu_bf16

    with force_triton(True), gpu_bf16():
        yield
