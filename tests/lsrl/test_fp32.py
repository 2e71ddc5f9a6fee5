"""fp32 behaviour of the built-ins, recorded (not hidden): which stay exact when compiled and run in fp32.

Folding multiplies the step gains ``mu`` of nested comparisons into single weights (up to 5e4 in the
compiled dictionary with mu = 100), so fp32 rounding there grows past the comparisons' margins and outputs
drift by up to ~2 (wrong letters); the majority and approximator paths keep their margins. The uncompiled
programs stay exact in fp32. fp64 is the default and reference dtype of every LSRL model.
"""

from __future__ import annotations

import torch

from rnnserve.engine.lsrl import run_program
from rnnserve.engine.lsrl.builtins import BUILTINS, build_builtin
from tests.lsrl.conftest import APPROXIMATOR, CELLS, DICTIONARY_VALUES, MAJORITY, PAIRS, model_outputs

# Built-in -> does the compiled model give every known answer in fp32? (measured, see module docstring)
COMPILED_FP32_EXACT = {"majority": True, "dictionary": False, "approximator": True}


def known_cases(name: str) -> list[str]:
    if name == "majority":
        return [text for text, _ in MAJORITY]
    if name == "dictionary":
        return [query + PAIRS for query in [*DICTIONARY_VALUES, "XYZ"]]
    return [query + CELLS for query, _ in APPROXIMATOR]


def test_which_builtins_stay_exact_in_fp32() -> None:
    measured = {}
    for name in BUILTINS:
        model64, tokenizer = build_builtin(name)
        model32 = build_builtin(name)[0].to(torch.float32)
        exact = True
        for text in known_cases(name):
            ids = tokenizer.encode(text)
            reference = model_outputs(model64, ids).round()
            exact &= torch.equal(model_outputs(model32, ids).double().round(), reference)
            interpreted = run_program(BUILTINS[name][0](), model64.embedding[ids].float(), dtype=torch.float32)
            assert torch.equal(interpreted.reshape(-1).double().round(), reference), (name, text)
        measured[name] = exact
    assert measured == COMPILED_FP32_EXACT


def test_loading_below_fp64_is_reported(caplog) -> None:
    model = build_builtin("majority")[0].to(torch.float32)
    with caplog.at_level("WARNING", logger="rnnserve.engine.models.lsrl"):
        model.state_spec()
    assert "below fp64" in caplog.text
