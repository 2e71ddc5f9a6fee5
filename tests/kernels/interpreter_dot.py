"""``tl.dot`` on bf16 operands as a GPU computes it, for kernels run under Triton's interpreter.

Triton 3.9's interpreter keeps a bf16 tensor as the uint16 bit patterns of its values and passes them to
``np.matmul`` as they are (``InterpreterBuilder.create_dot``), so a bf16 dot multiplies and sums the bit patterns
as integers: about 1e10 for operands near 1, whatever their values. A GPU widens each bf16 operand to fp32
(exactly: the bits become the high half of an fp32 word) and accumulates the products in fp32. The patch below
makes the interpreter do that, and leaves every other dot to the interpreter's own code.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import triton.language as tl
from triton.runtime import interpreter


def _widened(operand: interpreter.TensorHandle) -> np.ndarray:
    """The operand's values in fp32: bf16 bit patterns shifted into the high half of fp32 words (exact)."""
    if operand.dtype == tl.bfloat16:
        return (operand.data.astype(np.uint32) << np.uint32(16)).view(np.float32)
    return operand.data


@contextlib.contextmanager
def gpu_bf16_dot() -> Iterator[None]:
    """While active, the interpreter's ``tl.dot`` with a bf16 operand widens both operands to fp32 exactly and
    accumulates in fp32 (into the accumulator's dtype); other dots are the interpreter's."""
    builder = interpreter.InterpreterBuilder
    interpreters_dot = builder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if tl.bfloat16 not in (a.dtype, b.dtype):
            return interpreters_dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        product = np.matmul(_widened(a), _widened(b), dtype=np.float32)
        return interpreter.TensorHandle(product.astype(d.data.dtype) + d.data, d.dtype.scalar)

    builder.create_dot = create_dot
    try:
        yield
    finally:
        builder.create_dot = interpreters_dot
