"""LSRL primitives: the six node types a program is built from, plus arithmetic sugar on nodes.

A program is a DAG with exactly one :class:`Input` (the source) whose sink is the node the program
returns. It runs once per token (the paper's ``ForEach``); only :class:`LinState` carries anything from one
token to the next::

    Input(dim)                      x
    Lin(x, A, b)                    A x + b
    ReLU(x)                         max(0, x)
    LinState(x, A, B, b, s0)        s_t = A s_{t-1} + B x_t + b   (s_{-1} = s0; outputs s_t)
    Concat([x, y, ...])             (x, y, ...)
    Multi(x)                        x[:d/2] * x[d/2:]

Sugar (all built from ``Lin`` and ``Concat``): ``x[i]``, ``x[a:b]``, ``x[[i, j]]``, ``x + y``, ``x - y``,
``x + c``, ``c * x``, ``-x`` where ``c`` is a number or a constant vector.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from rnnserve.engine.lsrl import sparse

_ids = itertools.count()


class Node:
    """A variable of an LSRL program: a ``dim``-dimensional vector per token."""

    # numpy defers to the node's reflected operators: `np.array([1, 2]) * x` built an array of nodes, which
    # sum() then folded into 3 x
    __array_ufunc__ = None

    def __init__(self, dim: int, inputs: Sequence[Node] = ()) -> None:
        if dim < 1:
            raise ValueError(f"{type(self).__name__}: dimension must be >= 1, got {dim}")
        for x in inputs:
            if not isinstance(x, Node):
                raise TypeError(f"{type(self).__name__}: inputs must be LSRL nodes, got {type(x).__name__}")
        self.dim = dim
        self.inputs = tuple(inputs)
        self.id = next(_ids)

    def __repr__(self) -> str:
        return f"{type(self).__name__}#{self.id}(dim={self.dim})"

    def __getitem__(self, key: int | slice | Sequence[int]) -> Node:
        if isinstance(key, int):
            if not -self.dim <= key < self.dim:
                raise IndexError(f"index {key} out of range for dimension {self.dim}")
            index = [key % self.dim]
        elif isinstance(key, slice):
            index = list(range(self.dim))[key]
        else:
            index = [int(i) for i in key]
        if not index or any(not 0 <= i < self.dim for i in index):
            raise IndexError(f"empty or out-of-range selection {key!r} of a {self.dim}-dimensional node")
        return Lin(self, sparse.selection(index, self.dim))

    def __add__(self, other: Any) -> Node:
        if isinstance(other, Node):
            _check_same_dim(self, other)
            eye = sparse.identity(self.dim)
            return Lin(Concat([self, other]), sparse.hstack([eye, eye]))
        return Lin(self, sparse.identity(self.dim), sparse.as_vector(other, self.dim))

    def __radd__(self, other: Any) -> Node:
        return self + other

    def __neg__(self) -> Node:
        return Lin(self, sparse.identity(self.dim, -1.0))

    def __sub__(self, other: Any) -> Node:
        if isinstance(other, Node):
            return self + (-other)
        return self + (-sparse.as_vector(other, self.dim))

    def __rsub__(self, other: Any) -> Node:
        return (-self) + other

    def __mul__(self, other: Any) -> Node:
        if isinstance(other, Node):
            raise TypeError("the product of two variables needs Multi (see f_mul); '*' takes a constant")
        return Lin(self, sparse.diagonal(sparse.as_vector(other, self.dim)))

    def __rmul__(self, other: Any) -> Node:
        return self * other


def _check_same_dim(x: Node, y: Node) -> None:
    if x.dim != y.dim:
        raise ValueError(f"dimension mismatch: {x.dim} vs {y.dim}")


class Input(Node):
    """The program's input: one ``dim``-dimensional vector per token."""

    def __init__(self, dim: int) -> None:
        super().__init__(dim)


class Lin(Node):
    """``A x + b``; ``A`` is ``[out, x.dim]`` (dense or sparse), ``b`` defaults to zeros."""

    def __init__(self, x: Node, A: Any, b: Any = None) -> None:
        matrix = sparse.as_matrix(A)
        if matrix.shape[1] != x.dim:
            raise ValueError(f"Lin: A has {matrix.shape[1]} columns, input has dimension {x.dim}")
        super().__init__(matrix.shape[0], [x])
        self.A = matrix
        self.b = sparse.as_vector(b, self.dim)


class ReLU(Node):
    """Element-wise ``max(0, x)``."""

    def __init__(self, x: Node) -> None:
        super().__init__(x.dim, [x])


class LinState(Node):
    """Linear state update ``s_t = A s_{t-1} + B x_t + b`` starting from ``init_state``; outputs ``s_t``.

    ``A`` is ``[n, n]`` (dense or sparse, any structure), ``B`` is ``[n, x.dim]``.
    """

    def __init__(self, x: Node, A: Any, B: Any, b: Any = None, init_state: Any = None) -> None:
        a = sparse.as_matrix(A)
        n = a.shape[0]
        if a.shape[1] != n:
            raise ValueError(f"LinState: A must be square, got {tuple(a.shape)}")
        super().__init__(n, [x])
        self.A = a
        self.B = sparse.as_matrix(B, (n, x.dim))
        self.b = sparse.as_vector(b, n)
        self.init_state = sparse.as_vector(init_state, n)


class Concat(Node):
    """Concatenation of one or more variables."""

    def __init__(self, xs: Sequence[Node]) -> None:
        xs = list(xs)
        if not xs:
            raise ValueError("Concat needs at least one input")
        super().__init__(sum(x.dim for x in xs), xs)


class Multi(Node):
    """Element-wise product of the two halves of ``x`` (``x.dim`` must be even)."""

    def __init__(self, x: Node) -> None:
        if x.dim % 2:
            raise ValueError(f"Multi needs an even dimension, got {x.dim}")
        super().__init__(x.dim // 2, [x])


def topological_order(output: Node) -> list[Node]:
    """Every node ``output`` depends on, inputs before users (deterministic). ValueError naming the nodes of a
    cycle, for inputs reassigned after the nodes were built (``node.inputs = ...``): the interpreter and the
    compiler met a node before its input and failed with a bare KeyError."""
    order: list[Node] = []
    done: set[int] = set()
    parent: dict[int, Node | None] = {}  # the node whose input each expanded node is, on the current path
    stack: list[tuple[Node, bool, Node | None]] = [(output, False, None)]
    while stack:
        node, expanded, user = stack.pop()
        if expanded:
            order.append(node)
            done.add(node.id)
            continue
        if node.id in done:
            continue
        if node.id in parent:  # expanded and not done: it is on the path to ``user``, which reads it
            raise ValueError(_cycle_message(node, user, parent))
        parent[node.id] = user
        stack.append((node, True, user))
        stack.extend((x, False, node) for x in reversed(node.inputs) if x.id not in done)
    return order


def _cycle_message(node: Node, user: Node | None, parent: dict[int, Node | None]) -> str:
    """``node`` -> its user -> ... -> ``node``: each reads the one before it."""
    path = [node]
    while user is not None and user is not node:
        path.append(user)
        user = parent[user.id]
    cycle = " -> ".join(repr(n) for n in [*path, node])
    return (
        f"an LSRL program is a DAG, but the inputs of {len(path)} node(s) form a cycle: {cycle} (each node is an "
        "input of the next); a value carried from one token to the next is a LinState's state"
    )


def program_input(order: Sequence[Node]) -> Input:
    """The single :class:`Input` of a program (raises if there is none or more than one)."""
    inputs = [n for n in order if isinstance(n, Input)]
    if len(inputs) != 1:
        raise ValueError(f"an LSRL program needs exactly one Input, found {len(inputs)}")
    return inputs[0]
