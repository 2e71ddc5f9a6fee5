"""The format-independent parts of ``rnnserve convert``: safe pickle reading, detection, atomic output."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer, models

from rnnserve.engine import convert as convert_module
from rnnserve.engine.convert import (
    ConvertedCheckpoint,
    Converter,
    ConvertError,
    convert_checkpoint,
    find_converter,
    load_pickled_tensors,
    training_state_dict,
)
from rnnserve.server.cli import main

EXECUTED: list[str] = []


class Payload:
    """Unpickling this would run code: ``weights_only=True`` must refuse it."""

    def __reduce__(self):
        return (EXECUTED.append, ("pickled code ran",))


# This module doubles as a converter for files named *.toyckpt holding {"w": tensor}.
def detect(src: Path) -> bool:
    return src.suffix == ".toyckpt"


def convert(src: Path) -> ConvertedCheckpoint:
    state = load_pickled_tensors(src)
    return ConvertedCheckpoint({"architecture": "toy", "width": int(state["w"].shape[0])}, {"w": state["w"]},
                               notes=["toy"])


@pytest.fixture
def toy_format(monkeypatch):
    monkeypatch.setitem(convert_module.CONVERTERS, "toy", Converter("toy", "test format", __name__))


def test_weights_only_refuses_pickled_code(tmp_path):
    path = tmp_path / "evil.bin"
    with path.open("wb") as f:
        pickle.dump({"w": Payload()}, f)
    with pytest.raises(ConvertError, match="weights_only") as err:
        load_pickled_tensors(path)
    assert EXECUTED == []
    message = str(err.value)  # one line naming what was refused, and no advice to turn the protection off
    assert "\n" not in message and "holds code or a class" in message and "False" not in message


def test_a_destination_that_is_or_holds_the_source_is_refused(tmp_path, toy_format):
    """With --force the destination is replaced: were it the source's directory, the source would be gone."""
    src = tmp_path / "release" / "a.toyckpt"
    src.parent.mkdir()
    torch.save({"w": torch.ones(4)}, src)
    for dest in (src.parent, tmp_path, src):
        with pytest.raises(ConvertError, match="is or contains the source|not a directory"):
            convert_checkpoint(src, dest, overwrite=True)
    assert torch.equal(load_pickled_tensors(src)["w"], torch.ones(4))


def test_plain_tensors_load(tmp_path):
    path = tmp_path / "ok.bin"
    torch.save({"model": {"w": torch.arange(3.0)}, "iter_num": 7}, path)
    loaded = load_pickled_tensors(path)
    assert loaded["iter_num"] == 7 and torch.equal(loaded["model"]["w"], torch.arange(3.0))


def test_convert_writes_native_directory(tmp_path, toy_format):
    src = tmp_path / "a.toyckpt"
    torch.save({"w": torch.ones(4)}, src)
    tokenizer = tmp_path / "tok.json"
    Tokenizer(models.WordLevel({"a": 0, "b": 1}, unk_token="a")).save(str(tokenizer))
    dest = tmp_path / "out"
    convert_checkpoint(src, dest, tokenizer_json=tokenizer)
    assert json.loads((dest / "config.json").read_text()) == {"architecture": "toy", "width": 4}
    assert torch.equal(load_file(str(dest / "model.safetensors"))["w"], torch.ones(4))
    assert (dest / "tokenizer.json").read_bytes() == tokenizer.read_bytes()
    with pytest.raises(ConvertError, match="not empty"):
        convert_checkpoint(src, dest)
    torch.save({"w": torch.ones(2)}, src)
    convert_checkpoint(src, dest, overwrite=True)
    assert json.loads((dest / "config.json").read_text())["width"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.toyckpt", "out", "tok.json"]  # no staging left


def test_force_replaces_only_a_converted_checkpoint(tmp_path, toy_format):
    """``--force`` into a directory with other files (a home directory, a project) refuses and deletes nothing."""
    src = tmp_path / "a.toyckpt"
    torch.save({"w": torch.ones(4)}, src)
    dest = tmp_path / "project"
    (dest / "notes").mkdir(parents=True)
    (dest / "config.json").write_text("{}")
    (dest / "thesis.tex").write_text("years of work")
    with pytest.raises(ConvertError, match=r"holds files a converted checkpoint does not \(notes, thesis.tex\)"):
        convert_checkpoint(src, dest, overwrite=True)
    assert (dest / "thesis.tex").read_text() == "years of work" and (dest / "notes").is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.toyckpt", "project"]  # no staging left


def test_failed_convert_leaves_nothing(tmp_path, toy_format):
    src = tmp_path / "bad.toyckpt"
    src.write_bytes(b"not a checkpoint")
    with pytest.raises(ConvertError):
        convert_checkpoint(src, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.toyckpt"]


def test_unknown_sources_are_named(tmp_path):
    with pytest.raises(ConvertError, match="no such file"):
        convert_checkpoint(tmp_path / "missing", tmp_path / "out")
    other = tmp_path / "x.txt"
    other.write_text("x")
    with pytest.raises(ConvertError, match="no converter recognises"):
        find_converter(other)
    with pytest.raises(ConvertError, match="unknown format"):
        find_converter(other, "nope")


def test_cli_convert(tmp_path, toy_format, capsys):
    src = tmp_path / "a.toyckpt"
    torch.save({"w": torch.ones(3)}, src)
    assert main(["convert", str(src), str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "architecture=toy" in out and "parameters=3" in out and "note: toy" in out
    assert main(["convert", str(src), str(tmp_path / "out")]) == 1


def test_what_load_model_would_refuse_is_refused_before_writing(tmp_path):
    """A converted checkpoint whose tensors are not its architecture's, a tokenizer file that is none, a
    converter failing on values it did not expect, and a destination that cannot be written: ConvertErrors,
    and nothing is written."""
    from tests.engine.test_looped import save_authors_checkpoint

    save_authors_checkpoint(tmp_path / "ckpt.pt", "lt")
    data = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    short = {**data, "model": {**data["model"], "_orig_mod.transformer.attn.q.weight": torch.zeros(31, 32)}}
    torch.save(short, tmp_path / "short.pt")
    with pytest.raises(ConvertError, match=r"has shape \(31, 32\)"):
        convert_checkpoint(tmp_path / "short.pt", tmp_path / "out")
    torch.save({**data, "model_args": {**data["model_args"], "n_head": 0}}, tmp_path / "heads.pt")
    with pytest.raises(ConvertError, match="heads.pt"):
        convert_checkpoint(tmp_path / "heads.pt", tmp_path / "out")
    (tmp_path / "tok.json").write_text("{}")
    with pytest.raises(ConvertError, match="not a tokenizer.json"):
        convert_checkpoint(tmp_path / "ckpt.pt", tmp_path / "out", tokenizer_json=tmp_path / "tok.json")
    assert not (tmp_path / "out").exists()
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConvertError, match="not a directory"):
        convert_checkpoint(tmp_path / "ckpt.pt", tmp_path / "file")


WEIGHTS = {"backbone.w": torch.ones(2), "lm_head.weight": torch.zeros(3, 2)}


@pytest.mark.parametrize(
    ("payload", "where"),
    [
        (WEIGHTS, []),
        ({"state_dict": {f"model.{k}": v for k, v in WEIGHTS.items()}, "epoch": 3}, ["'state_dict' entry", "'model.'"]),
        ({"model": {f"_orig_mod.{k}": v for k, v in WEIGHTS.items()}, "optimizer": {}, "iter_num": 5},
         ["'model' entry", "'_orig_mod.'"]),
        ({f"module._orig_mod.{k}": v for k, v in WEIGHTS.items()}, ["'module.'", "'_orig_mod.'"]),
        ({"module": WEIGHTS, "global_steps": 9}, ["'module' entry"]),
    ],
)
def test_training_wrappers_and_prefixes_are_removed(payload: dict, where: list[str], tmp_path: Path) -> None:
    """Lightning's ``{"state_dict": ...}`` with its ``model.`` attribute prefix, nanoGPT's ``{"model": ...}`` under
    ``torch.compile`` (``_orig_mod.``), DDP's ``module.`` and DeepSpeed's ``{"module": ...}`` give the model's names."""
    state, notes = training_state_dict(payload, tmp_path / "ckpt.bin")
    assert state.keys() == WEIGHTS.keys() and all(torch.equal(state[k], WEIGHTS[k]) for k in WEIGHTS)
    assert len(notes) == len(where) and all(w in n for w, n in zip(where, notes, strict=True))


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ({**WEIGHTS, **{f"ema.{k}": v for k, v in WEIGHTS.items()}}, "EMA copy of the weights beside them"),
        ({"state_dict": WEIGHTS, "state_dict_ema": WEIGHTS}, "an EMA copy under 'state_dict_ema'"),
        ({"model": WEIGHTS, "model_ema": {"decay": 0.999}}, "an EMA copy under 'model_ema'"),
        ({"epoch": 3, "optimizer": {}}, r"no state dict of tensors.*top-level keys: \['epoch', 'optimizer'\]"),
        ([torch.ones(2)], "expected a state dict"),
    ],
)
def test_ema_copies_and_checkpoints_without_weights_are_named(payload: object, message: str, tmp_path: Path) -> None:
    """Which of the weights and their moving average to serve is the user's choice: never a silent pick."""
    with pytest.raises(ConvertError, match=message):
        training_state_dict(payload, tmp_path / "ckpt.bin")


def test_non_finite_tensors_are_refused_naming_them_unless_allowed(tmp_path, toy_format, capsys):
    """A diverged training run's checkpoint (NaN weights) converted without a word, then answered every request
    with NaN logits."""
    src, dest = tmp_path / "a.toyckpt", tmp_path / "out"
    torch.save({"w": torch.tensor([1.0, float("nan"), float("inf"), float("nan")])}, src)
    with pytest.raises(ConvertError, match=r"tensor w holds 2 NaN and 1 infinite numbers \(the first at \(1,\)\).*"
                                           "--allow-non-finite"):  # fmt: skip
        convert_checkpoint(src, dest)
    assert not dest.exists()
    assert main(["convert", str(src), str(dest)]) == 1
    assert not dest.exists()
    assert main(["convert", str(src), str(dest), "--allow-non-finite"]) == 0
    assert "note: w holds 2 NaN and 1 infinite numbers" in capsys.readouterr().out
    assert torch.isnan(load_file(str(dest / "model.safetensors"))["w"]).sum() == 2
