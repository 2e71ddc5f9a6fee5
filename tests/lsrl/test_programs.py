"""The paper's programs give their known answers, uncompiled (interpreter) and compiled (model)."""

from __future__ import annotations

import random
import string

import pytest
import torch

from rnnserve.engine.lsrl import compile_program, run_program
from rnnserve.engine.lsrl.programs import approximator, dictionary, majority
from rnnserve.engine.lsrl.tokens import TokenInterface
from rnnserve.engine.models.lsrl import LSRLModel
from tests.lsrl.conftest import (
    APPROXIMATOR,
    APPROXIMATOR_INPUTS,
    CAN_OUTPUTS,
    CELLS,
    DICTIONARY_VALUES,
    MAJORITY,
    PAIRS,
    letters,
    model_outputs,
)


def exact(y: torch.Tensor, expected: list[int], tolerance: float = 1e-6) -> bool:
    """Every output within ``tolerance`` of the expected integer (greedy decoding is then exact)."""
    return bool(((y.reshape(-1) - torch.tensor(expected, dtype=y.dtype)).abs() < tolerance).all())


@pytest.mark.parametrize(("text", "expected"), MAJORITY)
def test_majority(builtin, text: str, expected: list[int]) -> None:
    tokens = [float(c) for c in text]
    assert exact(run_program(majority(), torch.tensor(tokens).reshape(-1, 1)), expected)
    model, tokenizer = builtin["majority"]
    assert exact(model_outputs(model, tokenizer.encode(text)), expected)


def test_dictionary_interpreted() -> None:
    program = dictionary(3)
    y = run_program(program, torch.tensor(letters("CAN" + PAIRS), dtype=torch.float64).reshape(-1, 1))
    assert exact(y, CAN_OUTPUTS)
    y = run_program(program, torch.tensor(letters("XYZ" + PAIRS), dtype=torch.float64).reshape(-1, 1))
    assert exact(y, [0] * 33)


@pytest.mark.parametrize("query", [*DICTIONARY_VALUES, "XYZ", "CAT"])
def test_dictionary_compiled(builtin, query: str) -> None:
    model, tokenizer = builtin["dictionary"]
    y = model_outputs(model, tokenizer.encode(query + PAIRS))
    value = DICTIONARY_VALUES.get(query)
    expected_tail = [0, 0, 0] if value is None else [letters(value)[t % 3] for t in (30, 31, 32)]
    assert exact(y[-3:], expected_tail)
    if query == "CAN":
        assert exact(y, CAN_OUTPUTS)


def test_dictionary_relu_ifelse_also_compiles_exactly() -> None:
    """Our debranching bypasses are exact, so even Eq. 7's f_ifelse survives compilation in fp64."""
    model = LSRLModel.from_path(
        compile_program(dictionary(3, form="relu")), TokenInterface.scalar(["."] + list(string.ascii_uppercase))
    )
    for query, value in DICTIONARY_VALUES.items():
        y = model_outputs(model, letters(query + PAIRS))
        assert exact(y[-3:], [letters(value)[t % 3] for t in (30, 31, 32)]), query


@pytest.mark.parametrize("divisor", [22, 23, 50, 120])
def test_modulo_counter_resolves_every_divisor(divisor: int) -> None:
    """With the default gain (mu = 100) the step resolved divisors up to 22 only: 23 counted 0.93, 1.86, ..."""
    from rnnserve.engine.lsrl.helpers import f_modulo_counter
    from rnnserve.engine.lsrl.program import Input

    x = Input(1)
    y = run_program(f_modulo_counter(x, divisor), torch.zeros(3 * divisor, 1, dtype=torch.float64))
    assert exact(y, [t % divisor for t in range(3 * divisor)])


@pytest.mark.parametrize("form", ["multiplicative", "relu", "step"])
def test_dictionary_keys_of_twelve_tokens_and_prompts_past_the_relu_bound(form: str) -> None:
    """dictionary(12) answered zeros (its modulo-24 counter was wrong); the ReLU forms of f_ifelse answered
    garbage past ~100 tokens (the position they pass exceeded their default bound lam = 100)."""
    rng = random.Random(12)
    n, pairs = 12, 8
    keys = [[rng.randint(1, 26) for _ in range(n)] for _ in range(pairs)]
    values = [[rng.randint(1, 26) for _ in range(n)] for _ in range(pairs)]
    ids = keys[5] + [t for key, value in zip(keys, values, strict=True) for t in key + value]
    assert len(ids) > 200
    y = run_program(dictionary(n, form=form), torch.tensor(ids, dtype=torch.float64).reshape(-1, 1))
    assert exact(y[-n:], [values[5][t % n] for t in range(len(ids) - n, len(ids))])


@pytest.mark.parametrize(("query", "expected"), APPROXIMATOR)
def test_approximator(builtin, query: str, expected: list[int]) -> None:
    model, tokenizer = builtin["approximator"]
    ids = tokenizer.encode(query + CELLS)
    assert ids[1:] == tokenizer.encode(CELLS) and len(ids) == 5
    q = [float(v) for v in query.strip("()").split(",")]
    inputs = torch.tensor([[*q, 0.0, 0.0], *APPROXIMATOR_INPUTS], dtype=torch.float64)
    assert torch.equal(model.embedding[ids], inputs)
    assert exact(run_program(approximator(), inputs), expected)
    assert exact(model_outputs(model, ids), expected, tolerance=1e-9)


@pytest.mark.parametrize("n", [1, 2, 5])
def test_dictionary_other_key_lengths_compiled(n: int) -> None:
    rng = random.Random(n)
    query = [rng.randint(1, 26) for _ in range(n)]
    near_miss = [k % 26 + 1 for k in query]  # every token differs by one
    keys = [[rng.choice([k for k in range(1, 27) if k != query[0]])] + query[1:], near_miss, query, near_miss[:1]]
    keys[3] += query[1:]  # keys differ from the query in their first token only
    values = [[rng.randint(1, 26) for _ in range(n)] for _ in range(4)]
    ids = keys[2] + [t for key, value in zip(keys, values, strict=True) for t in key + value]
    model = LSRLModel.from_path(compile_program(dictionary(n)), TokenInterface.scalar([str(i) for i in range(27)]))
    y = model_outputs(model, ids)
    assert exact(y[-n:], [values[2][t % n] for t in range(len(ids) - n, len(ids))])
