"""``rnnserve convert`` for the Based authors' ``pytorch_model.bin`` directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rnnserve.engine.convert import ConvertError, convert_checkpoint, find_converter
from rnnserve.engine.loader import load_model
from rnnserve.engine.models.base import PrefillBatch
from rnnserve.engine.models.based import BasedLM
from rnnserve.engine.state_pool import StatePool
from rnnserve.server.cli import main
from tests.engine.test_based_reference import TINY_HF_CONFIG, random_state_dict, reference_logits


def _authors_release(path: Path, extra: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """config.json + pytorch_model.bin as the authors' training code saves it: ``model.``-prefixed keys, the
    tied embedding under both names (one storage), a metrics entry."""
    sd = random_state_dict(TINY_HF_CONFIG, seed=3)
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(TINY_HF_CONFIG))
    pickled = {f"model.{k}": v for k, v in sd.items()}
    pickled["model.train_metrics.count"] = torch.tensor(7)
    pickled.update(extra or {})
    torch.save(pickled, path / "pytorch_model.bin")
    return sd


@torch.inference_mode()
def test_convert_gives_a_directory_that_serves_the_reference(tmp_path: Path) -> None:
    sd = _authors_release(tmp_path / "release")
    assert find_converter(tmp_path / "release").name == "based"
    checkpoint = convert_checkpoint(tmp_path / "release", tmp_path / "native")
    assert any("metrics" in n for n in checkpoint.notes) and any("tied" in n for n in checkpoint.notes)
    assert sorted(p.name for p in (tmp_path / "native").iterdir()) == ["config.json", "model.safetensors"]
    assert json.loads((tmp_path / "native" / "config.json").read_text())["architecture"] == "based"
    model, _ = load_model(str(tmp_path / "native"), device="cpu", dtype="float32")
    prompt = torch.randint(0, 250, (37,), generator=torch.Generator().manual_seed(0)).tolist()
    logits = model.prefill(PrefillBatch.build([prompt], [0]), StatePool(model.state_spec(), 1).tensors)
    torch.testing.assert_close(logits[0], reference_logits(TINY_HF_CONFIG, sd, prompt)[-1], atol=2e-4, rtol=1e-4)


def test_cli_convert(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _authors_release(tmp_path / "release")
    assert main(["convert", str(tmp_path / "release"), str(tmp_path / "native"), "--format", "based"]) == 0
    assert "architecture=based" in capsys.readouterr().out


def test_wrong_shapes_and_unknown_weights_are_refused(tmp_path: Path) -> None:
    _authors_release(tmp_path / "extra", {"model.transformer.layers.0.mixer.gate.weight": torch.zeros(2)})
    with pytest.raises(ConvertError, match="unexpected weights .*mixer.gate.weight"):
        convert_checkpoint(tmp_path / "extra", tmp_path / "out")
    _authors_release(tmp_path / "shape", {"model.transformer.ln_f.weight": torch.ones(3)})
    with pytest.raises(ConvertError, match=r"ln_f.weight has shape \(3,\)"):
        convert_checkpoint(tmp_path / "shape", tmp_path / "out")
    _authors_release(tmp_path / "twice", {"transformer.ln_f.weight": torch.zeros(TINY_HF_CONFIG["n_embd"])})
    with pytest.raises(ConvertError, match="both name the weight transformer.ln_f.weight"):
        convert_checkpoint(tmp_path / "twice", tmp_path / "out")  # "model.x" and "x": one would replace the other
    assert not (tmp_path / "out").exists()


def test_plain_gpt2_release_is_not_detected(tmp_path: Path) -> None:
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    torch.save({"wte.weight": torch.zeros(2, 2)}, tmp_path / "gpt2" / "pytorch_model.bin")
    with pytest.raises(ConvertError, match="no converter recognises it"):
        find_converter(tmp_path / "gpt2")
    with pytest.raises(ConvertError, match="not a Based config"):
        convert_checkpoint(tmp_path / "gpt2", tmp_path / "out", format_name="based")


def test_string_booleans_in_the_authors_config_are_read_as_the_words_say(tmp_path: Path) -> None:
    """``"mlp_fc1_bias": "False"`` was truthy (refused as MLP biases) and ``"rms_norm": "True"`` was not ``True``
    (refused as LayerNorm); a word that is no boolean names its key."""
    words = {"rms_norm": "True", "mlp_fc1_bias": "False", "mlp_fc2_bias": "false", "scale_attn_weights": "TRUE",
             "tie_word_embeddings": "true", "residual_in_fp32": "True"}  # fmt: skip
    assert BasedLM.from_hf_config({**TINY_HF_CONFIG, **words}) == BasedLM.from_hf_config(TINY_HF_CONFIG)
    for key in ("mlp_fc1_bias", "rms_norm", "qkv_proj_bias"):
        with pytest.raises(ValueError, match=f"{key} must be true or false, got 'off'"):
            BasedLM.from_hf_config({**TINY_HF_CONFIG, key: "off"})


def _release_with_window(path: Path, window_size: object, **changes: object) -> None:
    _authors_release(path)
    config = {**TINY_HF_CONFIG, **changes, "alt_mixer_2": {**TINY_HF_CONFIG["alt_mixer_2"], "window_size": window_size}}
    (path / "config.json").write_text(json.dumps(config))


def test_a_null_window_size_is_refused_as_the_authors_code_refuses_it(tmp_path: Path) -> None:
    """``SlidingAttention(window_size=None)`` asserts in the authors' code, so no model with sliding-window layers
    has a null window; convert failed with a bare TypeError (``'<' not supported between 'NoneType' and 'int'``)."""
    _release_with_window(tmp_path / "release", None)
    with pytest.raises(ConvertError, match=r"alt_mixer_2.window_size is null for the sliding-window layers \[2, 3\]"):
        convert_checkpoint(tmp_path / "release", tmp_path / "out")
    with pytest.raises(ValueError, match="window_size is null"):
        BasedLM.from_hf_config(json.loads((tmp_path / "release" / "config.json").read_text()))
    _release_with_window(tmp_path / "text", "16")
    with pytest.raises(ConvertError, match="window_size must be int, got '16'"):
        convert_checkpoint(tmp_path / "text", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_null_window_size_no_layer_uses_is_read_as_the_authors_code_reads_it(tmp_path: Path) -> None:
    """No layer in ``alt_mixer_2_layers``: the authors never build a SlidingAttention, and the window is unread."""
    config = {**TINY_HF_CONFIG, "alt_mixer_2_layers": [], "alt_mixer_2": {**TINY_HF_CONFIG["alt_mixer_2"],
                                                                           "window_size": None}}  # fmt: skip
    based = BasedLM.from_hf_config(config)
    assert based.sliding_window_layers == [] and based.layer_kinds()[2:4] == ["conv", "linear_attention"]
