"""bf16 as a GPU computes it in Triton's interpreter: ``tl.dot`` on bf16 operands and integer -> bf16 casts.

Triton 3.9's interpreter keeps a bf16 tensor as the uint16 bit patterns of its values, and two of its operations
forget that:

- ``tl.dot`` (``InterpreterBuilder.create_dot``) passes the bit patterns to ``np.matmul`` as they are, so a bf16
  dot multiplies and sums the bit patterns as integers: about 1e10 for operands near 1, whatever their values.
  A GPU widens each bf16 operand to fp32 (exactly: the bits become the high half of an fp32 word) and
  accumulates the products in fp32.
- an integer's ``.to(tl.bfloat16)`` (``create_si_to_fp`` / ``create_ui_to_fp``) stores the integer itself as the
  bit pattern (``-3`` becomes ``0xFFFD``, a NaN) where a GPU rounds the value to the nearest bf16.

:func:`gpu_bf16` makes the interpreter do what the GPU does in both and leaves every other dot and cast to it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import triton.language as tl
from triton.runtime import interpreter

_Builder = interpreter.InterpreterBuilder
_Handle = interpreter.TensorHandle


def _widened(operand: _Handle) -> np.ndarray:
    """The operand's values in fp32: bf16 bit patterns shifted into the high half of fp32 words (exact)."""
    if operand.dtype == tl.bfloat16:
        return (operand.data.astype(np.uint32) << np.uint32(16)).view(np.float32)
    return operand.data


def _bf16_bits_of_integers(values: np.ndarray) -> np.ndarray:
    """Integers rounded to the nearest bf16 (8 significant bits, ties to even), as bf16 bit patterns."""
    mantissa, exponent = np.frexp(values.astype(np.float64))  # |mantissa| in [0.5, 1)
    rounded = np.ldexp(np.rint(mantissa * 256) / 256, exponent).astype(np.float32)  # exact in fp32
    return (rounded.view(np.uint32) >> np.uint32(16)).astype(np.uint16)


@contextlib.contextmanager
def gpu_bf16_dot() -> Iterator[None]:
    """While active, the interpreter's ``tl.dot`` with a bf16 operand widens both operands to fp32 exactly and
    accumulates in fp32 (into the accumulator's dtype); other dots are the interpreter's."""
    interpreters_dot = _Builder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if tl.bfloat16 not in (a.dtype, b.dtype):
            return interpreters_dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        product = np.matmul(_widened(a), _widened(b), dtype=np.float32)
        return _Handle(product.astype(d.data.dtype) + d.data, d.dtype.scalar)

    _Builder.create_dot = create_dot
    try:
        yield
    finally:
        _Builder.create_dot = interpreters_dot


@contextlib.contextmanager
def gpu_integer_to_bf16() -> Iterator[None]:
    """While active, the interpreter's integer -> bf16 casts round the values to the nearest bf16; other casts
    are the interpreter's."""
    originals = {name: getattr(_Builder, name) for name in ("create_si_to_fp", "create_ui_to_fp")}

    def patched(original):
        def create_int_to_fp(self, src, dst_type):
            if dst_type.scalar != tl.bfloat16:
                return original(self, src, dst_type)
            return _Handle(_bf16_bits_of_integers(src.data), tl.bfloat16)

        return create_int_to_fp

    for name, original in originals.items():
        setattr(_Builder, name, patched(original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(_Builder, name, original)


@contextlib.contextmanager
def gpu_bf16() -> Iterator[None]:
    """Both patches: bf16 dots and integer -> bf16 casts as a GPU computes them."""
    with gpu_bf16_dot(), gpu_integer_to_bf16():
        yield
