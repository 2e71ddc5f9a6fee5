"""LSRL primitives, sugar and helpers under the interpreter (hand-computed answers)."""

from __future__ import annotations

import re

import pytest
import torch

from rnnserve.engine.lsrl import (
    Concat,
    Input,
    Lin,
    LinState,
    Multi,
    ReLU,
    f_and,
    f_bump,
    f_ifelse,
    f_larger,
    f_modulo_counter,
    f_not,
    f_or,
    f_relu_identity,
    f_smaller,
    f_step,
    run_program,
)
from rnnserve.engine.lsrl.compiler import compile_program


def run(output, inputs) -> torch.Tensor:
    return run_program(output, torch.tensor(inputs, dtype=torch.float64).reshape(len(inputs), -1))


def test_primitives() -> None:
    x = Input(2)
    lin = Lin(x, [[1.0, 2.0], [0.0, -1.0]], b=[0.5, 0.0])
    state = LinState(lin, A=[[0.0, 1.0], [1.0, 0.0]], B=[[1.0, 0.0], [0.0, 1.0]], b=[1.0, 0.0], init_state=[3.0, 4.0])
    out = Concat([ReLU(lin), state, Multi(Concat([x, lin]))])
    y = run(out, [[1.0, 2.0], [-1.0, 1.0]])
    # token 0: lin = (5.5, -2); state = swap(3, 4) + lin + (1, 0) = (10.5, 1); multi = (1*5.5, 2*-2)
    # token 1: lin = (1.5, -1); state = swap(10.5, 1) + lin + (1, 0) = (3.5, 9.5); multi = (-1.5, -1)
    assert y.tolist() == [[5.5, 0.0, 10.5, 1.0, 5.5, -4.0], [1.5, 0.0, 3.5, 9.5, -1.5, -1.0]]


def test_sugar() -> None:
    x = Input(3)
    out = Concat([x[0], x[1:], x[[2, 0]], x + x, x - 1.0, 2.0 - x, x * [1.0, 2.0, 3.0], -x[2]])
    y = run(out, [[1.0, 2.0, 3.0]])[0].tolist()
    assert y == [1, 2, 3, 3, 1, 2, 4, 6, 0, 1, 2, 1, 0, -1, 1, 4, 9, -3]


def test_invalid_programs_are_rejected() -> None:
    x = Input(3)
    with pytest.raises(ValueError, match="even"):
        Multi(x)
    with pytest.raises(ValueError, match="columns"):
        Lin(x, [[1.0, 2.0]])
    with pytest.raises(ValueError, match="square"):
        LinState(x, A=[[1.0, 0.0]], B=[[1.0, 0.0, 0.0]])
    with pytest.raises(TypeError, match="Multi"):
        x * x
    with pytest.raises(ValueError, match="exactly one Input"):
        run_program(x + Input(3), torch.zeros(1, 3))


def test_a_cycle_of_inputs_is_refused_naming_its_nodes() -> None:
    """Inputs reassigned after the nodes were built: the interpreter and the compiler raised a bare KeyError (or
    "needs exactly one Input, found 0" when the cycle hid the Input)."""
    x = Input(1)
    a = Lin(x, [[1.0]])
    b = ReLU(a)
    c = Lin(Concat([b, x]), [[2.0, 1.0]])
    a.inputs = (c,)
    cycle = f"{c!r} -> {a!r} -> {b!r} -> {c.inputs[0]!r} -> {c!r}"
    for use in (lambda: run_program(c, torch.zeros(2, 1)), lambda: compile_program(c)):
        with pytest.raises(ValueError, match=f"the inputs of 4 node\\(s\\) form a cycle: {re.escape(cycle)}"):
            use()
    selfish = ReLU(x)
    selfish.inputs = (selfish,)
    with pytest.raises(ValueError, match=re.escape(f"form a cycle: {selfish!r} -> {selfish!r}")):
        run_program(selfish, torch.zeros(1, 1))


@pytest.mark.parametrize(
    "build", [lambda x: x + "a", lambda x: x * [1.0, "b", 2.0], lambda x: Lin(x, "abc"), lambda x: Lin(x, None)]
)
def test_non_numbers_are_named_in_the_error(build) -> None:
    """`x + "a"` raised torch's "new(): invalid data type 'str'", which names neither the value nor LSRL."""
    with pytest.raises(TypeError, match="LSRL constants and matrices hold numbers, got"):
        build(Input(3))


def test_step_and_logic_helpers() -> None:
    x = Input(2)
    out = Concat(
        [
            f_step(x[0], mu=10.0),
            f_and(x[0], x[1]),
            f_or(x[0], x[1]),
            f_not(x[1]),
            f_larger(x[0], x[1]),
            f_smaller(x[0], x[1]),
        ]
    )
    y = run(out, [[0.0, 0.0], [1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.05, 0.0]])
    expected = [[0, 0, 0, 1, 0, 0], [1, 0, 1, 1, 1, 0], [0, 0, 1, 0, 0, 1], [1, 1, 1, 0, 0, 0]]
    assert torch.allclose(y[:4], torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-12)
    assert y[4, 0].item() == pytest.approx(0.5)  # the ramp between 0 and 1/mu


def test_bump_with_variable_bounds() -> None:
    x = Input(3)
    out = f_bump(x[0], x[1], x[2])
    y = run(out, [[0.3, 0.0, 0.5], [0.6, 0.0, 0.5], [0.0, 0.0, 0.5], [0.5, 0.0, 0.5]]).reshape(-1)
    assert y.tolist() == pytest.approx([1.0, 0.0, 0.0, 1.0])  # cells are (lower, upper]


@pytest.mark.parametrize("form", ["multiplicative", "relu", "step"])
def test_ifelse_forms(form: str) -> None:
    x = Input(3)
    out = Concat([f_ifelse(x[0], x[1:], form=form), f_ifelse(x[0], x[1], x[2], form=form)])
    y = run(out, [[1.0, 7.0, -3.0], [0.0, 7.0, -3.0]])
    assert y.reshape(-1).tolist() == pytest.approx([7.0, -3.0, 7.0, 0.0, 0.0, -3.0])


def test_relu_identity() -> None:
    x = Input(2)
    assert run(f_relu_identity(x), [[-2.5, 3.0]]).tolist() == [[-2.5, 3.0]]


@pytest.mark.parametrize("divisor", [1, 2, 3, 6, 7])
def test_modulo_counter(divisor: int) -> None:
    x = Input(1)
    y = run(f_modulo_counter(x, divisor), [[0.0]] * 30).reshape(-1)
    assert torch.equal(y.round(), torch.arange(30, dtype=torch.float64) % divisor)
    assert (y - y.round()).abs().max() < 1e-9
