"""A compiled LSRL checkpoint loads back exactly, and a malformed one is refused at load with a one-line reason.

Each malformed case below used to load: an index outside its matrix or a persistent list outside the state made
every request fail (a 500 per request over HTTP), indices out of order or a persistent list that misses a column
``A`` reads gave wrong tokens without an error, non-finite weights served garbage, and an alphabet that disagrees
with the vocabulary gave a tokenizer that could not encode the model's own tokens; an op key no layer reads was
dropped without a word."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from rnnserve.engine import LLM, SamplingParams
from rnnserve.engine.loader import load_model, save_checkpoint
from rnnserve.engine.model_sources import ModelLoadError
from tests.lsrl.conftest import MAJORITY, model_outputs

# lsrl:majority: layer 0 is a linstate (A = I on 2 dimensions, persistent [0, 1]), layer 1 a linear with 4
# non-zeros in a [2, 2] matrix.
Config = dict[str, Any]
Weights = dict[str, torch.Tensor]


def _set(key: str, index: tuple[int, ...], value: float) -> Callable[[Weights], None]:
    def edit(weights: Weights) -> None:
        weights[key][index] = value

    return edit


def _op(index: int, **fields: Any) -> Callable[[Config], None]:
    def edit(config: Config) -> None:
        config["ops"][index].update(fields)

    return edit


def _reorder(weights: Weights) -> None:
    weights["layers.1.weight.indices"] = weights["layers.1.weight.indices"].flip(1).contiguous()


def _repeat(weights: Weights) -> None:
    indices = weights["layers.1.weight.indices"]
    indices[:, 1] = indices[:, 0]


MALFORMED = {
    "row out of range": (None, _set("layers.1.weight.indices", (0, 3), 2), "layers.1.weight.indices"),
    "column out of range": (None, _set("layers.1.weight.indices", (1, 0), 7), "layers.1.weight.indices"),
    "negative index": (None, _set("layers.0.A.indices", (1, 0), -1), "layers.0.A.indices"),
    "indices out of order": (None, _reorder, "row-major order"),
    "repeated index": (None, _repeat, "row-major order"),
    "persistent out of range": (_op(0, persistent=[0, 2]), None, "persistent"),
    "persistent negative": (_op(0, persistent=[-1, 0]), None, "persistent"),
    "persistent repeated": (_op(0, persistent=[0, 0, 1]), None, "persistent"),
    "persistent misses a column A reads": (_op(0, persistent=[0]), None, "persistent"),
    "NaN bias": (None, _set("layers.1.bias", (0,), float("nan")), "layers.1.bias"),
    "infinite weight": (None, _set("layers.3.weight.values", (1,), float("inf")), "layers.3.weight.values"),
    "NaN embedding": (None, _set("embedding", (1, 0), float("nan")), "embedding"),
    "infinite token value": (None, _set("token_values", (0,), float("inf")), "token_values"),
    "no token with a value": (None, lambda w: w["token_values"].fill_(float("nan")), "token_values"),
    "alphabet shorter than the vocabulary": (lambda c: c.update(alphabet=["0"]), None, "alphabet"),
    "repeated symbol": (lambda c: c.update(alphabet=["0", "0"]), None, "alphabet"),
    "empty symbol": (lambda c: c.update(alphabet=["0", ""]), None, "alphabet"),
    "no alphabet": (lambda c: c.pop("alphabet"), None, "alphabet"),
    # an op key the layer does not read (a later compiler's, a typo) was dropped: the program served without it
    "op key no layer reads": (_op(1, activation="gelu"), None, r"op 1 \(linear\) has keys \['activation'\] it does"),
    "linstate key missing": (lambda c: c["ops"][0].pop("a_nnz"), None, r"op 0 \(linstate\) .* lacks \['a_nnz'\]"),
    "linstate out_dim other than dim": (_op(0, out_dim=3), None, r"op 0 \(linstate\) outputs 2 numbers, but its out"),
}


@pytest.fixture
def majority_checkpoint(builtin, tmp_path: Path) -> Path:
    model, _ = builtin["majority"]
    save_checkpoint(model, tmp_path / "majority")
    return tmp_path / "majority"


def test_round_trip_serves_the_known_answers(builtin, majority_checkpoint: Path) -> None:
    model, tokenizer = builtin["majority"]
    loaded, loaded_tokenizer = load_model(str(majority_checkpoint), device="cpu")
    text, expected = MAJORITY[0]
    ids = tokenizer.encode(text)
    assert loaded_tokenizer.encode(text) == ids
    assert torch.equal(model_outputs(loaded, ids), model_outputs(model, ids))
    llm = LLM(str(majority_checkpoint), device="cpu", max_num_seqs=4)
    outputs = llm.generate([text[: i + 1] for i in range(len(text))], SamplingParams(temperature=0, max_tokens=1))
    assert [o.outputs[0].token_ids[0] for o in outputs] == expected


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_checkpoints_are_refused_at_load(majority_checkpoint: Path, case: str) -> None:
    edit_config, edit_weights, message = MALFORMED[case]
    if edit_config is not None:
        config = json.loads((majority_checkpoint / "config.json").read_text())
        edit_config(config)
        (majority_checkpoint / "config.json").write_text(json.dumps(config))
    if edit_weights is not None:
        weights = load_file(str(majority_checkpoint / "model.safetensors"))
        edit_weights(weights)
        save_file(weights, str(majority_checkpoint / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=message) as caught:
        load_model(str(majority_checkpoint), device="cpu")
    assert len(str(caught.value).splitlines()) == 1
