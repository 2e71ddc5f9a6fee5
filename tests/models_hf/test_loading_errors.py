"""HF checkpoint loading: repo ids from the local cache only, and one-line errors for broken checkpoints."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from rnnserve.engine.config import EngineConfig
from rnnserve.engine.llm_engine import LLMEngine
from rnnserve.engine.loader import ModelLoadError, load_model
from rnnserve.engine.sampling_params import InvalidParameterError, SamplingParams
from tests.models_hf import hf_harness

transformers = pytest.importorskip("transformers")


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    config = transformers.MambaConfig(vocab_size=64, hidden_size=16, state_size=4, num_hidden_layers=2)
    return hf_harness.save_hf(transformers.MambaForCausalLM(config), tmp_path / "ckpt")


def load_error(name: str | Path) -> str:
    with pytest.raises(ModelLoadError) as info:
        load_model(str(name), device="cpu")
    message = str(info.value)
    assert "\n" not in message
    return message


def test_missing_weight(checkpoint: Path) -> None:
    weights = load_file(str(checkpoint / "model.safetensors"))
    del weights["backbone.layers.1.mixer.A_log"]
    save_file(weights, str(checkpoint / "model.safetensors"))
    assert "missing weights ['backbone.layers.1.mixer.A_log']" in load_error(checkpoint)


def test_shape_mismatch(checkpoint: Path) -> None:
    config = json.loads((checkpoint / "config.json").read_text())
    config["state_size"] = 8
    (checkpoint / "config.json").write_text(json.dumps(config))
    message = load_error(checkpoint)
    assert "backbone.layers.0.mixer.A_log has shape (32, 4), config expects (32, 8)" in message


def test_unknown_model_type(checkpoint: Path) -> None:
    config = json.loads((checkpoint / "config.json").read_text())
    config["model_type"] = "llama"
    (checkpoint / "config.json").write_text(json.dumps(config))
    message = load_error(checkpoint)
    assert "unsupported Hugging Face model_type 'llama'" in message and "mamba" in message


def test_missing_shard(checkpoint: Path, tmp_path: Path) -> None:
    reference = transformers.MambaForCausalLM.from_pretrained(checkpoint)
    sharded = hf_harness.save_hf(reference, tmp_path / "sharded", max_shard_size="20KB")
    shards = sorted(sharded.glob("model-*.safetensors"))
    assert len(shards) > 1
    shards[-1].unlink()
    assert f"shard {shards[-1].name} listed in model.safetensors.index.json is missing" in load_error(sharded)


def test_a_tensor_the_shard_index_does_not_list_is_named(checkpoint: Path, tmp_path: Path) -> None:
    reference = transformers.MambaForCausalLM.from_pretrained(checkpoint)
    sharded = hf_harness.save_hf(reference, tmp_path / "sharded", max_shard_size="20KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    del index["weight_map"]["backbone.norm_f.weight"]
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    assert "holds backbone.norm_f.weight, which model.safetensors.index.json does not list" in load_error(sharded)


def test_an_untied_head_under_a_tied_config_is_refused(tmp_path: Path) -> None:
    """A checkpoint trained untied, whose config says (or defaults to) tied: its lm_head.weight used to replace
    the embedding without a word."""
    torch.manual_seed(0)
    config = transformers.MambaConfig(vocab_size=64, hidden_size=16, state_size=4, num_hidden_layers=2,
                                      tie_word_embeddings=False)  # fmt: skip
    untied = hf_harness.save_hf(transformers.MambaForCausalLM(config), tmp_path / "untied")
    assert load_model(str(untied), device="cpu")[0] is not None
    settings = json.loads((untied / "config.json").read_text())
    (untied / "config.json").write_text(json.dumps({**settings, "tie_word_embeddings": True}))
    assert "one tied weight" in load_error(untied) and "tie_word_embeddings" in load_error(untied)


def test_a_weight_stored_twice_is_refused(checkpoint: Path, tmp_path: Path) -> None:
    weights = load_file(str(checkpoint / "model.safetensors"))
    save_file({k: torch.zeros_like(v) for k, v in weights.items()}, str(checkpoint / "zz_old.safetensors"))
    assert "is stored twice" in load_error(checkpoint)
    reference = transformers.MambaForCausalLM.from_pretrained(tmp_path / "ckpt")
    sharded = hf_harness.save_hf(reference, tmp_path / "sharded", max_shard_size="20KB")
    shards = sorted(sharded.glob("model-*.safetensors"))
    last = load_file(str(shards[-1]))
    save_file({**last, **load_file(str(shards[0]))}, str(shards[-1]))  # the first's too
    assert "which the shard index puts in" in load_error(sharded)
    save_file(last, str(shards[-1]))  # the shards as they were, and beside them ...
    save_file({k: torch.zeros_like(v) for k, v in weights.items()}, str(sharded / "model.safetensors"))
    # ... a whole model.safetensors, which transformers loads instead of the shards: not silently ignored
    assert "model.safetensors is not one of the shards model.safetensors.index.json lists" in load_error(sharded)


def test_a_fifo_named_tokenizer_json_is_an_error_not_a_hang(checkpoint: Path) -> None:
    (checkpoint / "tokenizer.json").unlink()
    os.mkfifo(checkpoint / "tokenizer.json")
    assert "tokenizer.json: not a regular file" in load_error(checkpoint)


@pytest.mark.parametrize("dtype", [torch.int8, torch.bool, torch.float8_e4m3fn])
def test_weights_of_other_dtypes_are_refused(checkpoint: Path, dtype: torch.dtype) -> None:
    weights = load_file(str(checkpoint / "model.safetensors"))
    save_file({k: v.to(dtype) for k, v in weights.items()}, str(checkpoint / "model.safetensors"))
    assert f"has dtype {str(dtype).removeprefix('torch.')}" in load_error(checkpoint)


def test_broken_files_are_one_line_errors_naming_them(checkpoint: Path) -> None:
    weights = checkpoint / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    assert "model.safetensors: not a readable safetensors file" in load_error(checkpoint)
    weights.write_bytes(data)
    config = (checkpoint / "config.json").read_text()
    for broken in ("{not json", "[1, 2]", "null"):
        (checkpoint / "config.json").write_text(broken)
        assert "config.json" in load_error(checkpoint)
    (checkpoint / "config.json").write_text(config)
    (checkpoint / "config.json").unlink()
    os.mkfifo(checkpoint / "config.json")  # a read would block forever
    assert "config.json: not a regular file" in load_error(checkpoint)
    (checkpoint / "config.json").unlink()
    (checkpoint / "config.json").write_text(config)
    os.mkfifo(checkpoint / "extra.safetensors")
    assert "extra.safetensors: not a regular file" in load_error(checkpoint)
    (checkpoint / "extra.safetensors").unlink()
    index = {"metadata": {}, "weight_map": {"backbone.embeddings.weight": "../elsewhere.safetensors"}}
    (checkpoint / "model.safetensors.index.json").write_text(json.dumps(index))
    assert "is not a file of" in load_error(checkpoint)


def _fake_cache(cache: Path, repo_id: str, snapshot_of: Path, commit: str = "0123abcd") -> None:
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    (repo / "snapshots").mkdir()
    (snapshot_of).rename(repo / "snapshots" / commit)


def test_repo_id_from_local_cache(checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "hf_home" / "hub"
    _fake_cache(cache, "state-spaces/tiny-mamba", checkpoint)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model, tokenizer = load_model("state-spaces/tiny-mamba", device="cpu")
    assert model.architecture == "mamba" and tokenizer.vocab_size == 64
    message = load_error("state-spaces/tiny-mamba@v2")
    assert "revision 'v2' is not in the local cache" in message and str(cache) in message


def test_repo_id_absent_from_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    message = load_error("state-spaces/mamba-130m-hf")
    expected = tmp_path / "hub" / "models--state-spaces--mamba-130m-hf"
    repo = "'state-spaces/mamba-130m-hf'"
    assert message.startswith(f"{repo} is not a local directory nor in the local Hugging Face cache")
    assert f"{expected} does not exist" in message


def test_engine_never_imports_transformers() -> None:
    import subprocess
    import sys

    code = (
        "import sys, engine, engine.loader, engine.models, engine.hf_cache, engine.llm; "
        "assert 'transformers' not in sys.modules and 'huggingface_hub' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_text_the_tokenizer_maps_past_the_models_vocabulary_is_a_parameter_error(checkpoint: Path) -> None:
    """A tokenizer.json larger than the model's embedding: text reaching its extra ids is refused at the request
    (an IndexError inside the step before), and text within the vocabulary still runs."""
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {f"w{i}": i for i in range(200)}  # the model has 64 rows
    tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w1")).save(str(checkpoint / "tokenizer.json"))
    model, tokenizer = load_model(str(checkpoint), device="cpu")
    engine = LLMEngine(model, tokenizer, EngineConfig(max_num_seqs=1))
    with pytest.raises(InvalidParameterError, match="outside the model's vocabulary") as err:
        engine.add_request("w150", SamplingParams(max_tokens=1))
    assert err.value.param == "prompt"
    engine.add_request("w5", SamplingParams(max_tokens=1))
    while engine.has_unfinished_requests():
        assert all(out.error is None for out in engine.step())


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"layer_norm_epsilon": "1e-5"}, "norm_eps must be float"),  # loaded, then failed every request
        ({"hidden_size": -16, "intermediate_size": -32}, "cannot build the model"),
        ({"num_hidden_layers": "2"}, "must be int"),
        ({"use_conv_bias": "yes"}, "use_conv_bias must be true or false, got 'yes'"),
        ({"tie_word_embeddings": 0}, "tie_word_embeddings must be true or false, got 0"),
    ],
)
def test_config_values_of_the_wrong_type_or_size_are_load_errors(checkpoint: Path, change: dict, expected: str) -> None:
    settings = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps({**settings, **change}))
    assert expected in load_error(checkpoint)


def test_string_booleans_in_a_hf_config_are_read_as_the_words_say(checkpoint: Path) -> None:
    """``"use_bias": "False"`` was truthy: the model then expected bias weights the checkpoint does not have."""
    settings = json.loads((checkpoint / "config.json").read_text())
    words = {"use_bias": "False", "use_conv_bias": "TRUE", "tie_word_embeddings": "true", "residual_in_fp32": "false"}
    (checkpoint / "config.json").write_text(json.dumps({**settings, **words}))
    model, _ = load_model(str(checkpoint), device="cpu")
    config = model.config
    assert (config.use_bias, config.use_conv_bias, config.tie_embeddings, config.residual_in_fp32) == (
        False, True, True, False)  # fmt: skip


@pytest.mark.parametrize(("name", "content"), [("tokenizer.json", "{broken"), ("tokenizer.json", "[]"),
                                               ("tokenizer_config.json", "{broken"), ("tokenizer_config.json", "[1]")])
def test_broken_tokenizer_files_are_load_errors_naming_them(checkpoint: Path, name: str, content: str) -> None:
    (checkpoint / name).write_text(content)
    assert name in load_error(checkpoint)


@pytest.mark.parametrize("eos", [[1, "2"], "3", True, -1])
def test_an_eos_token_id_that_is_no_token_id_is_a_load_error(checkpoint: Path, eos: object) -> None:
    (checkpoint / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    assert "eos_token_id must be a token id or a list of them" in load_error(checkpoint)


def test_an_intermediate_size_transformers_would_replace_is_refused_naming_it(checkpoint: Path) -> None:
    """transformers' Mamba derives ``intermediate_size`` from ``expand`` and ignores config.json's value."""
    settings = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps({**settings, "intermediate_size": 48}))
    assert "intermediate_size 48 disagrees with expand 2 x hidden_size 16 = 32" in load_error(checkpoint)


def test_a_mamba2_config_without_the_gated_norm_is_refused_naming_it() -> None:
    """``rms_norm`` false (transformers 4's field, from mamba_ssm's ``rmsnorm``): transformers builds the gated norm
    anyway, so the model would be served as another one."""
    from rnnserve.engine.models.mamba2 import Mamba2LM

    config = {"model_type": "mamba2", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2, "num_heads": 4,
              "head_dim": 16, "n_groups": 1}
    assert Mamba2LM.from_hf_config({**config, "rms_norm": True}).n_heads == 4
    with pytest.raises(ValueError, match="rms_norm False: a Mamba-2 without its gated RMSNorm"):
        Mamba2LM.from_hf_config({**config, "rms_norm": False})
