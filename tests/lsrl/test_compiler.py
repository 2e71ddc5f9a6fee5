"""The compiler: folding keeps semantics, debranching yields a path, and compiled == interpreted."""

from __future__ import annotations

import random

import torch

from rnnserve.engine.lsrl import Concat, Input, Lin, LinState, Multi, Node, ReLU, compile_program, fold, run_program
from rnnserve.engine.lsrl.compiler import LinOp, LinStateOp, MultiOp, Path, ReLUOp
from rnnserve.engine.lsrl.program import topological_order
from rnnserve.engine.lsrl.tokens import TokenInterface
from rnnserve.engine.models.lsrl import LSRLModel


def random_matrix(rng: random.Random, rows: int, cols: int, density: float = 0.6) -> torch.Tensor:
    values = [
        [rng.gauss(0.0, 1.0) / cols**0.5 if rng.random() < density else 0.0 for _ in range(cols)] for _ in range(rows)
    ]
    return torch.tensor(values, dtype=torch.float64)


def random_program(rng: random.Random) -> Node:
    """A random DAG over all six primitives with a scalar output."""
    pool: list[Node] = [Input(rng.randint(1, 3))]
    for _ in range(rng.randint(2, 12)):
        x = rng.choice(pool)
        kind = rng.choice(["lin", "relu", "linstate", "concat", "multi"])
        if kind == "lin":
            dim = rng.randint(1, 4)
            node: Node = Lin(x, random_matrix(rng, dim, x.dim), [rng.gauss(0.0, 0.5) for _ in range(dim)])
        elif kind == "relu":
            node = ReLU(x)
        elif kind == "linstate":
            n = rng.randint(1, 3)
            a = random_matrix(rng, n, n)
            a = 0.9 * a / max(1.0, float(torch.linalg.matrix_norm(a, 2)))  # keep states bounded
            node = LinState(
                x,
                a,
                random_matrix(rng, n, x.dim),
                [rng.gauss(0.0, 0.5) for _ in range(n)],
                [rng.gauss(0.0, 1.0) for _ in range(n)],
            )
        elif kind == "concat":
            node = Concat(rng.sample(pool, min(len(pool), rng.randint(1, 3))))
        else:
            node = Multi(Concat([x, rng.choice([p for p in pool if p.dim == x.dim])]))
        pool.append(node)
    picked = Concat(rng.sample(pool[1:], min(len(pool) - 1, 3)))
    return Lin(picked, random_matrix(rng, 1, picked.dim, density=1.0))


def assert_is_path(path: Path) -> None:
    """One op per layer, each consuming the previous one's output, with the folds applied."""
    width = path.input_dim
    previous = None
    for op in path.ops:
        assert isinstance(op, (LinOp, ReLUOp, MultiOp, LinStateOp))
        assert op.in_dim == width
        if isinstance(op, MultiOp):
            assert op.in_dim % 2 == 0
        if isinstance(previous, LinOp):
            assert not isinstance(op, (LinOp, LinStateOp)), "Lin∘Lin and Lin→LinState must be folded"
        if isinstance(previous, ReLUOp):
            assert not isinstance(op, ReLUOp)
        width, previous = op.out_dim, op
    assert width == path.output_dim


def test_fold_applies_the_preparation_rules() -> None:
    x = Input(2)
    inner = Lin(x, [[1.0, 1.0], [2.0, 0.0]], [1.0, 0.0])
    state = LinState(Lin(inner, [[1.0, -1.0]]), A=[[0.5]], B=[[2.0]], init_state=[1.0])
    out = Concat([ReLU(ReLU(inner)), state, Concat([state, state])])
    folded = fold(out)
    kinds = [type(n).__name__ for n in topological_order(folded)]
    assert kinds.count("ReLU") == 1 and kinds.count("Concat") == 1
    folded_state = next(n for n in topological_order(folded) if isinstance(n, LinState))
    assert isinstance(folded_state.inputs[0], Input)  # both Lins absorbed into B and b
    inputs = torch.randn(6, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(run_program(folded, inputs), run_program(out, inputs), rtol=1e-12, atol=1e-12)


def test_majority_compiles_to_one_linstate_layer() -> None:
    x = Input(1)
    out = LinState(x, [[1.0]], [[1.0]]) - LinState(1.0 - x, [[1.0]], [[1.0]])
    path = compile_program(out)
    assert [type(op) for op in path.ops] == [LinStateOp, LinOp]
    assert path.ops[0].A._nnz() == 2 and path.ops[0].persistent.tolist() == [0, 1]


def test_bypass_lanes_are_not_persisted() -> None:
    x = Input(1)
    counter = LinState(x, [[1.0]], [[1.0]])
    later = LinState(ReLU(counter), [[0.5]], [[1.0]])
    path = compile_program(Concat([later, x]))  # x travels through the second LinState as a bypass
    second = [op for op in path.ops if isinstance(op, LinStateOp)][1]
    assert second.out_dim > 1 and second.persistent.tolist() == [0]


def test_compiled_equals_interpreted_on_200_random_programs() -> None:
    rng = random.Random(1234)
    generator = torch.Generator().manual_seed(1234)
    for index in range(200):
        program = random_program(rng)
        path = compile_program(program)
        assert_is_path(path)
        lengths = [rng.randint(1, 7), rng.randint(1, 7)]
        inputs = torch.randn(sum(lengths), path.input_dim, dtype=torch.float64, generator=generator)
        reference = torch.cat([run_program(program, seq) for seq in inputs.split(lengths)])
        tokens = TokenInterface(("a", "b"), torch.zeros(2, path.input_dim, dtype=torch.float64), torch.zeros(2))
        model = LSRLModel.from_path(path, tokens)
        cu_seqlens = torch.tensor([0, lengths[0], sum(lengths)])
        compiled, _ = model.run_vectors(inputs, cu_seqlens, model.initial_state(2))
        assert torch.allclose(compiled, reference, rtol=1e-9, atol=1e-9), f"program {index}"
        if index % 10 == 0:  # the path is itself an LSRL program
            chained = run_program(path.to_program(), inputs[: lengths[0]])
            assert torch.allclose(chained, reference[: lengths[0]], rtol=1e-9, atol=1e-9)
