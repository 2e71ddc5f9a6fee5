"""The LSRL helper library (paper Sec. 3, Sec. 5 and App. F), built only from the six primitives.

Logical helpers assume inputs in {0, 1}; ``mu`` is the gain of the ReLU step approximation (the step
is exact for ``|x| >= 1/mu``), ``lam`` the bound on ``|t|, |f|`` the ReLU forms of ``f_ifelse`` rely on.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch

from rnnserve.engine.lsrl import sparse
from rnnserve.engine.lsrl.program import Concat, Lin, LinState, Multi, Node, ReLU

DEFAULT_MU = 100.0
DEFAULT_LAMBDA = 100.0
IfElseForm = Literal["multiplicative", "relu", "step"]


def f_constant(x: Node, value: Any) -> Node:
    """A constant vector (``x`` only anchors it in the program)."""
    vector = torch.as_tensor(value, dtype=sparse.DTYPE).reshape(-1)
    return Lin(x, sparse.zeros(vector.numel(), x.dim), vector)


def f_step(x: Node, mu: float = DEFAULT_MU) -> Node:
    """``ReLU(mu x) - mu ReLU(x - 1/mu)``: 0 for ``x <= 0``, 1 for ``x >= 1/mu``, linear in between."""
    eye = sparse.identity(x.dim)
    both = Concat([ReLU(x * mu), ReLU(x - 1.0 / mu)])
    return Lin(both, sparse.hstack([eye, sparse.identity(x.dim, -mu)]))


def f_bump(x: Node, lower: Any, upper: Any, mu: float = DEFAULT_MU) -> Node:
    """1 where ``lower < x <= upper`` (up to the step ramps), else 0; bounds may be variables."""
    return f_step(x - lower, mu) - f_step(x - upper, mu)


def f_not(x: Node) -> Node:
    """Logical not of a 0/1 value: ``1 - x``."""
    return 1.0 - x


def f_and(x: Node, y: Node, mu: float = DEFAULT_MU) -> Node:
    """Logical and of two 0/1 values (each thresholded with :func:`f_step`)."""
    return ReLU(f_step(x, mu) + f_step(y, mu) - 1.0)


def f_or(x: Node, y: Node, mu: float = DEFAULT_MU) -> Node:
    """Logical or of two 0/1 values: :func:`f_step` of ``x + y``."""
    return f_step(x + y, mu)


def f_larger(x: Node, y: Any, mu: float = DEFAULT_MU) -> Node:
    """``x > y`` as 0/1 (``y`` a variable or a constant)."""
    return f_step(x - y, mu)


def f_smaller(x: Node, y: Any, mu: float = DEFAULT_MU) -> Node:
    """``x < y`` as 0/1 (``y`` a variable or a constant)."""
    return f_step(-(x - y), mu)


def f_relu_identity(x: Node) -> Node:
    """``x`` computed through ReLUs: ``ReLU(x) - ReLU(-x)`` (App. F.6)."""
    eye = sparse.identity(x.dim)
    return Lin(Concat([ReLU(x), ReLU(-x)]), sparse.hstack([eye, sparse.identity(x.dim, -1.0)]))


def f_mul(x: Node, y: Node) -> Node:
    """Element-wise product of two variables (a gate): ``Multi(Concat([x, y]))``."""
    if x.dim != y.dim:
        raise ValueError(f"f_mul: dimension mismatch {x.dim} vs {y.dim}")
    return Multi(Concat([x, y]))


def _broadcast(cond: Node, dim: int) -> Node:
    if cond.dim == dim:
        return cond
    if cond.dim != 1:
        raise ValueError(f"condition of dimension {cond.dim} cannot select a {dim}-dimensional value")
    return Lin(cond, torch.ones(dim, 1, dtype=sparse.DTYPE))


def f_ifelse(
    cond: Node,
    t: Node,
    f: Node | None = None,
    *,
    form: IfElseForm = "multiplicative",
    lam: float = DEFAULT_LAMBDA,
    mu: float = DEFAULT_MU,
) -> Node:
    """``t`` where ``cond`` is 1, ``f`` where it is 0 (``f=None`` means zeros, dropping its terms).

    ``multiplicative`` is Eq. 10 (``cond*t + (1-cond)*f`` with Multi, stable); ``relu`` is Eq. 7 and
    ``step`` Eq. 9, both ReLU-only (compile to a plain linear RNN) and both need ``|t|, |f| < lam``.
    A one-dimensional ``cond`` applies to every component of ``t``.
    """
    if f is not None and f.dim != t.dim:
        raise ValueError(f"f_ifelse: t has dimension {t.dim}, f has {f.dim}")
    cond = _broadcast(cond, t.dim)
    if form == "multiplicative":
        taken = f_mul(cond, t)
        return taken if f is None else taken + f_mul(f_not(cond), f)
    if form == "relu":
        block_t, block_f = f_not(cond) * -lam, cond * -lam
    elif form == "step":
        block_t = f_step(cond - 0.5, mu) * lam - lam
        block_f = f_step(0.5 - cond, mu) * lam - lam
    else:
        raise ValueError(f"unknown f_ifelse form {form!r}")
    out = ReLU(block_t + t) - ReLU(block_t - t)
    if f is not None:
        out = out + ReLU(block_f + f) - ReLU(block_f - f)
    return out


def f_modulo_counter(x: Node, divisor: int, mu: float = DEFAULT_MU) -> Node:
    """``t mod divisor`` at token ``t`` (from 0), by a unit vector rotating ``1/divisor`` turn per token. The
    current slot clears the threshold ``cos(pi / divisor)`` by ``1 - cos(pi / divisor)``: the step's gain is
    raised to twice its inverse where ``mu`` is smaller (``mu = 100`` resolves divisors up to 22 only)."""
    if divisor < 1:
        raise ValueError(f"divisor must be >= 1, got {divisor}")
    angle = 2.0 * math.pi / divisor
    mu = max(mu, 2.0 / (1.0 - math.cos(angle / 2)))
    rotation = torch.tensor(
        [[math.cos(angle), -math.sin(angle)], [math.sin(angle), math.cos(angle)]], dtype=sparse.DTYPE
    )
    unit = torch.tensor([1.0, 0.0], dtype=sparse.DTYPE)
    cycler = LinState(x, A=rotation, B=sparse.zeros(2, x.dim), init_state=rotation.T @ unit)
    extractor = torch.stack([torch.linalg.matrix_power(rotation, i) @ unit for i in range(divisor)])
    one_hot = f_larger(Lin(cycler, extractor), math.cos(angle / 2), mu)
    return Lin(one_hot, torch.arange(divisor, dtype=sparse.DTYPE).reshape(1, -1))
