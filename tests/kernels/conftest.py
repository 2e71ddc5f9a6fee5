"""Kernel-test fixture: force the Triton kernels on CPU tensors through the interpreter."""

from __future__ import annotations

import os

import pytest

from rnnserve.kernels.backend import HAS_TRITON, force_triton


@pytest.fixture
def triton_on_cpu():
    """Run the Triton kernels on CPU tensors through the interpreter (skips if that is unavailable), its ``tl.dot``
    on bf16 operands computed as a GPU computes it (``tests/kernels/interpreter_dot.py``)."""
    if not HAS_TRITON or os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs triton and TRITON_INTERPRET=1")
    from tests.kernels.interpreter_dot import gpu_bf16_dot

    with force_triton(True), gpu_bf16_dot():
        yield
