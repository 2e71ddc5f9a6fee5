"""Checkpoint directories, random presets and the safetensors-only rule."""

from __future__ import annotations

import json
import pickle
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from rnnserve.engine.loader import ModelLoadError, load_model, save_checkpoint
from rnnserve.engine.models import MODEL_REGISTRY
from rnnserve.engine.models.base import PrefillBatch
from rnnserve.engine.state_pool import StatePool
from tests.engine.conftest import tiny_model


def _logits(model, ids: list[int]) -> torch.Tensor:
    pool = StatePool(model.state_spec(), 1)
    return model.prefill(PrefillBatch.build([ids], [0]), pool.tensors)


def test_save_and_load_round_trip(tmp_path: Path, architecture: str) -> None:
    model = tiny_model(architecture, seed=3)
    save_checkpoint(model, tmp_path)
    loaded, tokenizer = load_model(str(tmp_path), device="cpu")
    assert loaded.architecture == architecture
    assert json.loads((tmp_path / "config.json").read_text())["architecture"] == architecture
    torch.testing.assert_close(_logits(loaded, [1, 2, 3, 4]), _logits(model, [1, 2, 3, 4]), atol=0, rtol=0)
    assert tokenizer.eos_token_id == 256


def test_pickle_only_directory_is_refused(tmp_path: Path) -> None:
    save_checkpoint(tiny_model("mingru"), tmp_path)
    (tmp_path / "model.safetensors").unlink()
    (tmp_path / "pytorch_model.bin").write_bytes(pickle.dumps({"not": "loaded"}))
    with pytest.raises(ModelLoadError, match="pickle") as err:
        load_model(str(tmp_path), device="cpu")
    assert "\n" not in str(err.value)


def test_missing_and_misshaped_weights_are_named(tmp_path: Path) -> None:
    model = tiny_model("mingru")
    save_checkpoint(model, tmp_path)
    weights = {k: v.clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    dropped = dict(weights)
    del dropped["layers.1.in_proj.weight"]
    save_file(dropped, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"missing weights \['layers.1.in_proj.weight'\]"):
        load_model(str(tmp_path), device="cpu")
    weights["norm_f.weight"] = torch.zeros(5)
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"norm_f.weight has shape \(5,\)"):
        load_model(str(tmp_path), device="cpu")


def test_unknown_architecture_and_preset(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"architecture": "nonsense"}')
    with pytest.raises(ModelLoadError, match="unknown architecture 'nonsense'"):
        load_model(str(tmp_path), device="cpu")
    with pytest.raises(ModelLoadError, match="unknown preset"):
        load_model("random:does-not-exist", device="cpu")
    with pytest.raises(ModelLoadError):
        load_model(str(tmp_path / "absent"), device="cpu")


def test_random_presets_are_deterministic_and_honour_dtype() -> None:
    a, _ = load_model("random:mingru-tiny", device="cpu")
    b, _ = load_model("random:mingru-tiny", device="cpu", dtype="bfloat16")
    assert next(b.parameters()).dtype == torch.bfloat16
    torch.testing.assert_close(a.embed.weight.to(torch.bfloat16), b.embed.weight)


def test_bf16_checkpoint_loads_as_bf16(tmp_path: Path) -> None:
    save_checkpoint(tiny_model("minlstm").to(torch.bfloat16), tmp_path)
    model, _ = load_model(str(tmp_path), device="cpu")
    assert next(model.parameters()).dtype == torch.bfloat16


def test_auto_device_is_cpu_without_cuda() -> None:
    model, _ = load_model("random:mingru-tiny", device="auto")
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert next(model.parameters()).device.type == expected


def _record_builds(monkeypatch: pytest.MonkeyPatch, architecture: str) -> list[str]:
    """The device each build of ``architecture`` is made on, in order."""
    built_on: list[str] = []
    cls = MODEL_REGISTRY[architecture]

    class Recorded(cls):  # type: ignore[misc, valid-type]
        def __init__(self, model_config: object) -> None:
            built_on.append(torch.empty(0).device.type)
            super().__init__(model_config)

    monkeypatch.setitem(MODEL_REGISTRY, architecture, Recorded)
    return built_on


def test_weights_are_checked_against_the_config_before_the_model_takes_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A config.json whose sizes disagree with the weights (here a vocabulary of four million) fails on the
    model's layout on the meta device: it used to allocate and initialise the whole model first (2.2 GB here,
    an out-of-memory kill for larger sizes)."""
    save_checkpoint(tiny_model("mingru"), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "vocab_size": 4_000_000}))
    built_on = _record_builds(monkeypatch, config["architecture"])
    with pytest.raises(ModelLoadError, match=r"config expects \(4000000, "):
        load_model(str(tmp_path), device="cpu")
    assert built_on == ["meta"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    built_on.clear()
    load_model(str(tmp_path), device="cpu")
    assert built_on == ["meta"]  # the weights became its parameters: no second, randomly initialised build


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_weights_become_the_parameters_in_the_requested_dtype_and_tied(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dtype: str
) -> None:
    """The meta-device layout takes the checkpoint's tensors as its parameters, each converted as it is read:
    a bf16 model from an fp32 checkpoint never holds an fp32 copy of the model. Tied parameters stay one
    tensor, and every parameter owns memory from torch's allocator (aligned for the CPU kernels), not a view
    of the mapped file."""
    reference, _ = load_model("random:mamba-tiny", device="cpu")
    save_checkpoint(reference, tmp_path)
    built_on = _record_builds(monkeypatch, "mamba")
    model, _ = load_model(str(tmp_path), device="cpu", dtype=dtype)
    assert built_on == ["meta"]
    assert model.lm_head.weight is model.backbone.embeddings.weight
    reference = reference.to(getattr(torch, dtype))
    for name, param in model.state_dict().items():
        assert param.dtype == getattr(torch, dtype) and param.data_ptr() % 64 == 0, name
        torch.testing.assert_close(param, reference.state_dict()[name], atol=0, rtol=0)
    assert not any(p.requires_grad for p in model.parameters())
    torch.testing.assert_close(_logits(model, [5, 6, 7]), _logits(reference, [5, 6, 7]), atol=0, rtol=0)


@pytest.mark.parametrize(("odd_ones", "expected"), [("embeddings", torch.float32), ("A_log", torch.bfloat16)])
def test_mixed_dtypes_load_in_the_dtype_of_most_weights(tmp_path: Path, odd_ones: str, expected: torch.dtype) -> None:
    """Without a dtype asked for, a checkpoint whose weights differ loads in the dtype of most of its elements: an
    fp32 model with a bf16 embedding stays fp32 (it once became bf16 whole, by the first tensor in key order), a
    bf16 model with an fp32 ``A_log`` (as some releases store it) stays bf16."""
    model, _ = load_model("random:mamba-tiny", device="cpu")
    save_checkpoint(model, tmp_path)
    minority = torch.bfloat16 if expected == torch.float32 else torch.float32
    tensors = {k: v.to(minority if odd_ones in k else expected) for k, v in model.state_dict().items()}
    tensors.pop("lm_head.weight")  # tied: stored once
    save_file(tensors, str(tmp_path / "model.safetensors"))
    loaded, _ = load_model(str(tmp_path), device="cpu")
    assert {p.dtype for p in loaded.state_dict().values()} == {expected}


TINY_PRESETS = [
    "mamba-tiny", "mamba2-tiny", "mingru-tiny", "minlstm-tiny", "hawk-tiny", "griffin-tiny", "based-tiny",
    "lattice-tiny", "looped-tiny", "tmlt-tiny", "lstm-tiny", "gru-tiny", "rnn-tiny",
]  # fmt: skip


@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_a_checkpoint_loaded_in_bf16_is_the_model_cast_in_memory(tmp_path: Path, preset: str) -> None:
    """Every architecture, saved in fp32 and loaded as bf16 (each weight converted as it is read), gives the
    logits of the same model cast with ``.to(torch.bfloat16)``; also a table a model derives from its weights (the
    timestep-modulated looped transformer's), which it once computed from the bf16 weights in bf16 arithmetic."""
    model, _ = load_model(f"random:{preset}", device="cpu")
    save_checkpoint(model, tmp_path)
    loaded, _ = load_model(str(tmp_path), device="cpu", dtype="bfloat16")
    ids = [5, 9, 2, 7, 1]
    torch.testing.assert_close(_logits(loaded, ids), _logits(model.to(torch.bfloat16), ids), atol=0, rtol=0)


def test_integer_buffers_stored_as_floats_keep_the_models_dtype(tmp_path: Path) -> None:
    """A compiled LSRL program's index tables stored as floats are cast back to int64 (loading in bf16 would
    otherwise round indices above 256)."""
    model, _ = load_model("lsrl:dictionary", device="cpu")
    save_checkpoint(model, tmp_path)
    path = tmp_path / "model.safetensors"
    tensors = {k: v.double() if "indices" in k else v for k, v in load_file(str(path)).items()}
    assert any("indices" in k for k in tensors)
    save_file(tensors, str(path))
    loaded, _ = load_model(str(tmp_path), device="cpu")
    for name, buffer in loaded.named_buffers():
        if "indices" in name:
            assert buffer.dtype == torch.int64 and torch.equal(buffer, model.get_buffer(name))


def test_a_model_deriving_a_tensor_in_its_constructor_is_built_for_real(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tensor a constructor computes and keeps outside the state dict would stay on the meta device if the
    weights were only assigned; such a model is built on the CPU and the weights copied in."""
    save_checkpoint(tiny_model("mingru", seed=2), tmp_path)
    built_on = _record_builds(monkeypatch, "mingru")
    architecture = MODEL_REGISTRY["mingru"]

    class Derived(architecture):  # type: ignore[misc, valid-type]
        def __init__(self, model_config: object) -> None:
            super().__init__(model_config)
            self.derived = [torch.arange(3.0)]

    monkeypatch.setitem(MODEL_REGISTRY, "mingru", Derived)
    model, _ = load_model(str(tmp_path), device="cpu")
    assert built_on == ["meta", "cpu"]
    assert torch.equal(model.derived[0], torch.arange(3.0))
    torch.testing.assert_close(_logits(model, [1, 2]), _logits(tiny_model("mingru", seed=2), [1, 2]), atol=0, rtol=0)


@pytest.mark.parametrize("value", ["False", "false", "FALSE", False])
def test_a_string_boolean_in_config_json_is_read_as_the_word_says(tmp_path: Path, value: object) -> None:
    """Training scripts write ``"bias": "False"``: Python's truthiness read it as true (a model with biases)."""
    model, _ = load_model("random:looped-tiny", device="cpu")
    save_checkpoint(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "bias": value}))
    loaded, _ = load_model(str(tmp_path), device="cpu")
    assert loaded.config.bias is False and loaded.block.q.bias is None


@pytest.mark.parametrize("value", ["no", "0", "", 0, 1, None, [False]])
def test_a_config_value_that_is_no_boolean_is_refused_naming_the_field(tmp_path: Path, value: object) -> None:
    model, _ = load_model("random:looped-tiny", device="cpu")
    save_checkpoint(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "bias": value}))
    with pytest.raises(ModelLoadError, match=f"bias must be true or false, got {re.escape(repr(value))}"):
        load_model(str(tmp_path), device="cpu")


def test_every_architecture_reads_its_boolean_fields_strictly() -> None:
    """One helper for every config: each boolean field of each architecture takes ``"true"``/``"false"`` in any
    case and refuses anything else, naming the field."""
    for cls in MODEL_REGISTRY.values():
        defaults = cls.config_class()
        booleans = [f for f, v in defaults.to_dict().items() if isinstance(v, bool)]
        for field in booleans:
            value = getattr(defaults, field)
            parsed = cls.config_class.from_dict({**defaults.to_dict(), field: str(value).upper()})
            assert getattr(parsed, field) is value, (cls.architecture, field)
            with pytest.raises(ValueError, match=f"{field} must be true or false, got 'maybe'"):
                cls.config_class.from_dict({**defaults.to_dict(), field: "maybe"})


def _with_weight(path: Path, name: str, edit) -> None:
    weights = load_file(str(path / "model.safetensors"))
    edit(weights[name])
    save_file(weights, str(path / "model.safetensors"))


@pytest.mark.parametrize("bad", [float("nan"), float("-inf")])
def test_a_small_weight_holding_nan_or_inf_is_a_load_error_naming_it(tmp_path: Path, bad: float) -> None:
    """Norms, biases and SSM parameters (the weights of at most FINITE_CHECK_MAX_ELEMENTS) are checked: a diverged
    training run's NaN loaded and then gave NaN logits for every request."""
    model, _ = load_model("random:mamba-tiny", device="cpu")
    save_checkpoint(model, tmp_path)
    _with_weight(tmp_path, "backbone.layers.1.mixer.D", lambda w: w.__setitem__(3, bad))
    with pytest.raises(ModelLoadError, match=r"weight backbone.layers.1.mixer.D holds \d NaN and \d infinite numbers "
                                             r"\(the first at \(3,\)\)"):  # fmt: skip
        load_model(str(tmp_path), device="cpu")


def test_a_small_weight_beyond_the_range_of_the_dtype_asked_for_is_a_load_error(tmp_path: Path) -> None:
    model, _ = load_model("random:mamba-tiny", device="cpu")
    save_checkpoint(model, tmp_path)
    _with_weight(tmp_path, "backbone.layers.0.mixer.D", lambda w: w.__setitem__(0, 1e6))
    with pytest.raises(ModelLoadError, match="mixer.D holds numbers up to 1e[+]06, beyond the range of float16"):
        load_model(str(tmp_path), device="cpu", dtype="float16")
    assert load_model(str(tmp_path), device="cpu", dtype="bfloat16")[0].backbone.layers[0].mixer.D[0] == 1e6
