"""Known answers for the built-in LSRL programs (notes §4) and shared helpers."""

from __future__ import annotations

import pytest
import torch

from rnnserve.engine.lsrl.builtins import build_builtin
from rnnserve.engine.models.lsrl import LSRLModel

MAJORITY = [
    ("101100011101", [1, 0, 1, 1, 1, 0, 0, 0, 1, 1, 1, 1]),
    ("0110001100", [0, 0, 1, 0, 0, 0, 0, 0, 0, 0]),
]
PAIRS = "AUSVIEBULSOFCANOTTDENCOPENGLON"
CAN_OUTPUTS = [0] * 18 + [15, 20, 20] * 5  # O T T, the output at t is register t mod 3
DICTIONARY_VALUES = {"AUS": "VIE", "BUL": "SOF", "CAN": "OTT", "DEN": "COP", "ENG": "LON"}
CELLS = "[0,0]=1[0,0.5]=2[0.5,0]=3[0.5,0.5]=4"
APPROXIMATOR = [
    ("(0.7,0.2)", [0, 0, 0, 3, 3]),
    ("(0.2,0.7)", [0, 0, 2, 2, 2]),
    ("(0.1,0.1)", [0, 1, 1, 1, 1]),
    ("(0,0.2)", [0, 0, 0, 0, 0]),
]
APPROXIMATOR_INPUTS = [[0.5, 0.0, 0.0, 1.0], [0.5, 0.0, 0.5, 2.0], [0.5, 0.5, 0.0, 3.0], [0.5, 0.5, 0.5, 4.0]]


def letters(text: str) -> list[int]:
    """Dictionary tokens: ``.`` is 0, ``A``..``Z`` are 1..26."""
    return [0 if c == "." else ord(c) - ord("A") + 1 for c in text]


def rotated(value: str, length: int) -> str:
    """The greedy continuation of a prompt of ``length`` tokens whose matched value is ``value``."""
    n = len(value)
    return "".join(value[t % n] for t in range(length - 1, length - 1 + 7))


def model_outputs(model: LSRLModel, token_ids: list[int]) -> torch.Tensor:
    """Per-position program outputs of the compiled model on one fresh sequence."""
    cu_seqlens = torch.tensor([0, len(token_ids)])
    y, _ = model.run_vectors(model.embedding[token_ids], cu_seqlens, model.initial_state(1))
    return y.reshape(-1)


@pytest.fixture(scope="session")
def builtin() -> dict[str, tuple]:
    return {name: build_builtin(name) for name in ("majority", "dictionary", "approximator")}
