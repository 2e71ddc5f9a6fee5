"""The LSRL compiler: fold the program DAG, then debranch it into a path of layers (paper App. A).

1. :func:`fold` — the preparation step: ``Lin∘Lin`` becomes one ``Lin``, a ``Lin`` feeding a ``LinState``
   is absorbed into its ``B`` and ``b``, ``ReLU∘ReLU`` is one ``ReLU`` and a ``Concat`` of one repeated
   input is a ``Lin``.
2. :func:`debranch` — removes every branch. ``Lin`` and ``Concat`` nodes are free: each is an affine map
   of the values computed so far, so branches through them merge by composing matrices (Cases 4, 5A, 5B,
   8). The remaining nodes (``ReLU``, ``LinState``, ``Multi``) are scheduled stage by stage; a stage
   applies one op type to every ready node of that type at once — parallel ``LinState``s fuse into one
   block-diagonal ``LinState`` (Case 2), parallel ``ReLU``s into one ``ReLU`` (Case 3), parallel
   ``Multi``s into one ``Multi`` (Case 1A) — while every value still needed later is carried through
   the stage by an exact bypass: a ``LinState`` with ``A = 0, B = I`` (Case 6), the ReLU identity
   ``ReLU(x) - ReLU(-x)`` (Cases 7B, 9, 10; one lane when ``x`` is known non-negative) or a product with
   the constant 1 (Case 1B). The type of each stage is the one of the ready node on the longest remaining
   chain, which keeps the path short.

The result is a :class:`Path`: an ordered list of ops, each consuming only the previous op's output.
Consecutive ``Lin`` ops never occur and a ``Lin`` before a ``LinState`` is always absorbed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rnnserve.engine.lsrl import sparse
from rnnserve.engine.lsrl.program import (
    Concat,
    Input,
    Lin,
    LinState,
    Multi,
    Node,
    ReLU,
    program_input,
    topological_order,
)


@dataclass(frozen=True)
class LinOp:
    """``y = W x + b``; ``W`` is sparse ``[out, in]``."""

    weight: torch.Tensor
    bias: torch.Tensor

    @property
    def in_dim(self) -> int:
        return self.weight.shape[1]

    @property
    def out_dim(self) -> int:
        return self.weight.shape[0]


@dataclass(frozen=True)
class ReLUOp:
    dim: int

    @property
    def in_dim(self) -> int:
        return self.dim

    @property
    def out_dim(self) -> int:
        return self.dim


@dataclass(frozen=True)
class MultiOp:
    """``y = x[:d/2] * x[d/2:]``."""

    in_dim: int

    @property
    def out_dim(self) -> int:
        return self.in_dim // 2


@dataclass(frozen=True)
class LinStateOp:
    """``s_t = A s_{t-1} + B x_t + b`` from ``init_state``; outputs ``s_t``. ``A``, ``B`` sparse."""

    A: torch.Tensor
    B: torch.Tensor
    bias: torch.Tensor
    init_state: torch.Tensor

    @property
    def in_dim(self) -> int:
        return self.B.shape[1]

    @property
    def out_dim(self) -> int:
        return self.A.shape[0]

    @property
    def persistent(self) -> torch.Tensor:
        """State dimensions read at the next token (non-zero columns of ``A``): the only ones to keep."""
        return sparse.used_columns(self.A)


PathOp = LinOp | ReLUOp | MultiOp | LinStateOp


@dataclass(frozen=True)
class Path:
    """A compiled program: ops applied in order to each token (a stack of linear-RNN layers)."""

    input_dim: int
    output_dim: int
    ops: tuple[PathOp, ...]

    def to_program(self) -> Node:
        """The path as an LSRL program (a chain of primitives), e.g. to run it with the interpreter."""
        x: Node = Input(self.input_dim)
        for op in self.ops:
            if isinstance(op, LinOp):
                x = Lin(x, op.weight, op.bias)
            elif isinstance(op, ReLUOp):
                x = ReLU(x)
            elif isinstance(op, MultiOp):
                x = Multi(x)
            else:
                x = LinState(x, op.A, op.B, op.bias, op.init_state)
        return x

    @property
    def num_parameters(self) -> int:
        """Stored non-zeros plus dense vectors."""
        total = 0
        for op in self.ops:
            if isinstance(op, LinOp):
                total += op.weight._nnz() + op.out_dim
            elif isinstance(op, LinStateOp):
                total += op.A._nnz() + op.B._nnz() + 2 * op.out_dim
        return total


def compile_program(output: Node) -> Path:
    """Fold and debranch ``output``'s program into a :class:`Path`."""
    return debranch(fold(output))


def _lin(x: Node, A: torch.Tensor, b: torch.Tensor) -> Node:
    if isinstance(x, Lin):
        return Lin(x.inputs[0], sparse.matmul(A, x.A), sparse.matvec(A, x.b) + b)
    return Lin(x, A, b)


def fold(output: Node) -> Node:
    """The preparation step of App. A; returns an equivalent program's output node."""
    new: dict[int, Node] = {}
    for node in topological_order(output):
        ins = [new[x.id] for x in node.inputs]
        if isinstance(node, Input):
            folded: Node = node
        elif isinstance(node, Lin):
            folded = _lin(ins[0], node.A, node.b)
        elif isinstance(node, ReLU):
            folded = ins[0] if isinstance(ins[0], ReLU) else ReLU(ins[0])
        elif isinstance(node, LinState):
            x = ins[0]
            B, b = node.B, node.b
            if isinstance(x, Lin):
                B, b, x = sparse.matmul(B, x.A), sparse.matvec(B, x.b) + b, x.inputs[0]
            folded = LinState(x, node.A, B, b, node.init_state)
        elif isinstance(node, Concat):
            if all(x is ins[0] for x in ins):
                eye = sparse.identity(ins[0].dim)
                folded = _lin(ins[0], sparse.vstack([eye] * len(ins)), torch.zeros(node.dim, dtype=sparse.DTYPE))
            else:
                folded = Concat(ins)
        elif isinstance(node, Multi):
            folded = Multi(ins[0])
        else:
            raise TypeError(f"unknown LSRL node {node!r}")
        new[node.id] = folded
    return new[output.id]


@dataclass
class _Affine:
    """``M @ atoms + c``: a value as an affine map of the materialised values ("atoms")."""

    M: torch.Tensor
    c: torch.Tensor


class _Debrancher:
    """State of the stage-by-stage scheduling (see the module docstring)."""

    def __init__(self, output: Node) -> None:
        order = topological_order(output)
        self.input = program_input(order)
        self.output = output
        self.materialised = [n for n in order if isinstance(n, (Input, ReLU, LinState, Multi))]
        self.atom_start: dict[int, int] = {}
        owner: list[int] = []
        for node in self.materialised:
            self.atom_start[node.id] = len(owner)
            owner.extend([node.id] * node.dim)
        self.num_atoms = len(owner)
        self.atom_owner = torch.tensor(owner, dtype=torch.long)
        self.expr: dict[int, _Affine] = {}
        for node in order:
            self.expr[node.id] = self._expression(node)
        self.pending = [n for n in self.materialised if not isinstance(n, Input)]
        self.deps = {n.id: self._owners(self.expr[n.inputs[0].id].M) for n in self.pending}
        self.height = self._heights()
        # Layout of the current path output h: atom i = E[i] @ h for every available atom (bypasses are
        # linear, so no offset is ever needed).
        self.E = sparse.vstack(
            [sparse.identity(self.input.dim), sparse.zeros(self.num_atoms - self.input.dim, self.input.dim)]
        )
        self.available = {self.input.id}
        self.nonneg = torch.zeros(self.num_atoms, dtype=torch.bool)
        self.ops: list[PathOp] = []

    def _atoms(self, node: Node) -> torch.Tensor:
        start = self.atom_start[node.id]
        return torch.arange(start, start + node.dim)

    def _expression(self, node: Node) -> _Affine:
        if node.id in self.atom_start:
            return _Affine(
                sparse.selection(self._atoms(node), self.num_atoms), torch.zeros(node.dim, dtype=sparse.DTYPE)
            )
        if isinstance(node, Lin):
            inner = self.expr[node.inputs[0].id]
            return _Affine(sparse.matmul(node.A, inner.M), sparse.matvec(node.A, inner.c) + node.b)
        if isinstance(node, Concat):
            parts = [self.expr[x.id] for x in node.inputs]
            return _Affine(sparse.vstack([p.M for p in parts]), torch.cat([p.c for p in parts]))
        raise TypeError(f"unknown LSRL node {node!r}")

    def _owners(self, M: torch.Tensor) -> set[int]:
        return {int(i) for i in torch.unique(self.atom_owner[sparse.used_columns(M)])}

    def _heights(self) -> dict[int, int]:
        users: dict[int, list[int]] = {n.id: [] for n in self.materialised}
        for node in self.pending:
            for dep in self.deps[node.id]:
                users[dep].append(node.id)
        height: dict[int, int] = {}
        for node in reversed(self.materialised):
            height[node.id] = 1 + max((height[u] for u in users[node.id]), default=0)
        return height

    def _current(self, expr: _Affine) -> _Affine:
        """``expr`` as an affine map of the current path output."""
        return _Affine(sparse.matmul(expr.M, self.E), expr.c)

    def _carried(self, remaining: Sequence[Node]) -> torch.Tensor:
        """Available atoms that a later stage or the output still reads."""
        mats = [self.expr[n.inputs[0].id].M for n in remaining] + [self.expr[self.output.id].M]
        used = sparse.used_columns(sparse.vstack(mats))
        return used[torch.isin(self.atom_owner[used], torch.tensor(sorted(self.available)))]

    def _emit_lin(self, rows: list[_Affine]) -> None:
        weight = sparse.vstack([r.M for r in rows])
        bias = torch.cat([r.c for r in rows])
        if not (sparse.is_identity(weight) and bool((bias == 0).all())):
            self.ops.append(LinOp(weight, bias))

    def _set_layout(self, width: int, atoms: torch.Tensor, lanes: torch.Tensor, signs: torch.Tensor) -> None:
        """New ``E``: ``atoms[k] += signs[k] * h[lanes[k]]`` (entries for the same atom add up)."""
        self.E = sparse.from_coo(torch.stack([atoms, lanes]), signs, (self.num_atoms, width))

    def run(self) -> Path:
        while self.pending:
            ready = [n for n in self.pending if self.deps[n.id] <= self.available]
            leader = max(ready, key=lambda n: self.height[n.id])
            stage = [n for n in ready if type(n) is type(leader)]
            staged = {n.id for n in stage}
            self.pending = [n for n in self.pending if n.id not in staged]
            carried = self._carried(self.pending)
            carry = _Affine(sparse.rows(self.E, carried), torch.zeros(len(carried), dtype=sparse.DTYPE))
            inputs = [self._current(self.expr[n.inputs[0].id]) for n in stage]
            if isinstance(leader, ReLU):
                self._relu_stage(stage, inputs, carried, carry)
            elif isinstance(leader, LinState):
                self._linstate_stage(stage, inputs, carried, carry)
            else:
                self._multi_stage(stage, inputs, carried, carry)
            self.available |= staged
        self._emit_lin([self._current(self.expr[self.output.id])])
        return Path(self.input.dim, self.output.dim, tuple(self.ops))

    def _stage_atoms(self, stage: list[Node]) -> torch.Tensor:
        return torch.cat([self._atoms(n) for n in stage])

    def _relu_stage(self, stage: list[Node], inputs: list[_Affine], carried: torch.Tensor, carry: _Affine) -> None:
        own = self._stage_atoms(stage)
        split = ~self.nonneg[carried]
        negative = _Affine(sparse.prune(-sparse.rows(carry.M, torch.nonzero(split).reshape(-1))), -carry.c[split])
        self._emit_lin([*inputs, carry, negative])
        width = len(own) + len(carried) + int(split.sum())
        lanes = torch.arange(width)
        atoms = torch.cat([own, carried, carried[split]])
        signs = torch.cat([torch.ones(len(own) + len(carried)), -torch.ones(int(split.sum()))])
        self.ops.append(ReLUOp(width))
        self._set_layout(width, atoms, lanes, signs)
        self.nonneg[own] = True

    def _linstate_stage(
        self, stage: list[LinState], inputs: list[_Affine], carried: torch.Tensor, carry: _Affine
    ) -> None:
        n_carry = len(carried)
        A = sparse.block_diag([n.A for n in stage] + [sparse.zeros(n_carry, n_carry)])
        B = sparse.vstack([sparse.matmul(n.B, x.M) for n, x in zip(stage, inputs, strict=True)] + [carry.M])
        bias = torch.cat([sparse.matvec(n.B, x.c) + n.b for n, x in zip(stage, inputs, strict=True)] + [carry.c])
        init = torch.cat([n.init_state for n in stage] + [torch.zeros(n_carry, dtype=sparse.DTYPE)])
        self.ops.append(LinStateOp(A, B, bias, init))
        atoms = torch.cat([self._stage_atoms(stage), carried])
        self._set_layout(len(atoms), atoms, torch.arange(len(atoms)), torch.ones(len(atoms)))

    def _multi_stage(self, stage: list[Node], inputs: list[_Affine], carried: torch.Tensor, carry: _Affine) -> None:
        firsts = [_Affine(sparse.rows(x.M, range(n.dim)), x.c[: n.dim]) for n, x in zip(stage, inputs, strict=True)]
        seconds = [
            _Affine(sparse.rows(x.M, range(n.dim, 2 * n.dim)), x.c[n.dim :]) for n, x in zip(stage, inputs, strict=True)
        ]
        width = carry.M.shape[1]
        ones = _Affine(sparse.zeros(len(carried), width), torch.ones(len(carried), dtype=sparse.DTYPE))
        self._emit_lin([*firsts, carry, *seconds, ones])
        atoms = torch.cat([self._stage_atoms(stage), carried])
        self.ops.append(MultiOp(2 * len(atoms)))
        self._set_layout(len(atoms), atoms, torch.arange(len(atoms)), torch.ones(len(atoms)))


def debranch(output: Node) -> Path:
    """Turn the program DAG of ``output`` into a :class:`Path` (see the module docstring)."""
    return _Debrancher(output).run()
