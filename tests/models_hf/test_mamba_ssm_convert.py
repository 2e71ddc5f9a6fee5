"""``rnnserve convert`` for releases of the Mamba authors' own package (state-spaces/mamba-*, mamba2-*): their
``config.json`` (``d_model``, ``n_layer``, ``ssm_cfg``, a padded vocabulary) and ``pytorch_model.bin`` in
``mamba_ssm``'s names, written here from ``transformers`` models of the same sizes; the converted checkpoint
gives ``transformers``' logits, with ``--tokenizer`` or serving token ids."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers

from rnnserve.engine.convert import ConvertError, convert_checkpoint, find_converter
from rnnserve.engine.loader import load_model
from rnnserve.engine.models.base import PrefillBatch
from rnnserve.engine.models.mamba_ssm_checkpoint import hf_config
from rnnserve.engine.state_pool import StatePool
from rnnserve.engine.tokenizer import TokenIdTokenizer
from tests.models_hf.hf_harness import hf_greedy, prompts

transformers = pytest.importorskip("transformers")

CASES = {  # the release's config.json, and the transformers config of the same model
    "mamba": (
        {"d_model": 32, "n_layer": 2, "vocab_size": 61, "ssm_cfg": {"d_state": 8}, "rms_norm": True,
         "residual_in_fp32": True, "fused_add_norm": True, "pad_vocab_size_multiple": 8, "tie_embeddings": True},
        lambda: transformers.MambaConfig(vocab_size=64, hidden_size=32, state_size=8, num_hidden_layers=2),
    ),
    "mamba2": (
        {"d_model": 32, "d_intermediate": 0, "n_layer": 2, "vocab_size": 60, "attn_layer_idx": [], "attn_cfg": {},
         "ssm_cfg": {"layer": "Mamba2", "d_state": 16, "headdim": 16, "ngroups": 2}, "rms_norm": True,
         "residual_in_fp32": True, "fused_add_norm": True, "pad_vocab_size_multiple": 16, "tie_embeddings": True},
        lambda: transformers.Mamba2Config(vocab_size=64, hidden_size=32, state_size=16, num_hidden_layers=2,
                                          num_heads=4, head_dim=16, n_groups=2, tie_word_embeddings=True),
    ),
}  # fmt: skip


def authors_release(case: str, path: Path, wrap: Callable[[dict], object] = lambda state: state) -> torch.nn.Module:
    """A ``transformers`` model with random weights, saved as the authors' package saves it (or as a training
    script saved the same state dict: ``wrap``)."""
    config, hf_config = CASES[case]
    torch.manual_seed(0)
    reference = transformers.AutoModelForCausalLM.from_config(hf_config()).eval()
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    state = {k.replace("backbone.embeddings.", "backbone.embedding."): v for k, v in reference.state_dict().items()}
    torch.save(wrap(state), path / "pytorch_model.bin")
    return reference


@pytest.mark.parametrize("case", sorted(CASES))
@torch.inference_mode()
def test_a_converted_release_gives_the_transformers_logits(case: str, tmp_path: Path) -> None:
    reference = authors_release(case, tmp_path / "release")
    assert find_converter(tmp_path / "release").name == "mamba_ssm"
    checkpoint = convert_checkpoint(tmp_path / "release", tmp_path / "native")
    assert checkpoint.config["architecture"] == case and any("padded" in n for n in checkpoint.notes)
    model, tokenizer = load_model(str(tmp_path / "native"), device="cpu", dtype="float32")
    assert isinstance(tokenizer, TokenIdTokenizer) and tokenizer.vocab_size == 64
    from rnnserve import LLM, SamplingParams

    llm = LLM(str(tmp_path / "native"), device="cpu", dtype="float32", max_num_seqs=2)
    for prompt in prompts(64, [5, 17]):
        expected = hf_greedy(reference, prompt, 6, stop_at_eos=False, use_cache=False)
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
        [out] = llm.generate([prompt], params)
        assert out.outputs[0].token_ids == expected
        logits = reference(torch.tensor([prompt])).logits[0, -1].float().log_softmax(-1)
        first = out.outputs[0].logprobs[0]  # type: ignore[index]
        assert first.logprob == pytest.approx(float(logits[first.token_id]), abs=1e-4)
    vocab = {f"w{i}": i for i in range(64)}
    words = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    words.save(str(tmp_path / "tokenizer.json"))
    convert_checkpoint(tmp_path / "release", tmp_path / "named", tokenizer_json=tmp_path / "tokenizer.json")
    _, named = load_model(str(tmp_path / "named"), device="cpu")
    assert named.encode("w3 w9") == [3, 9]


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"attn_layer_idx": [1]}, "attention layers"),
        ({"d_intermediate": 64}, "MLP blocks"),
        ({"rms_norm": False}, "LayerNorm"),
        ({"rms_norm": "False"}, "LayerNorm"),  # was truthy: converted as RMSNorm
        ({"rms_norm": "off"}, "rms_norm must be true or false, got 'off'"),
        ({"ssm_cfg": {"layer": "Mamba2", "headdim": 16, "ngroups": 2, "d_state": 16, "rmsnorm": False}}, "gated"),
        ({"ssm_cfg": {"layer": "Mamba2", "headdim": 16, "ngroups": 2, "d_state": 16, "D_has_hdim": True}}, "a D per"),
    ],
)
def test_what_the_native_models_do_not_compute_is_refused(change: dict, reason: str, tmp_path: Path) -> None:
    authors_release("mamba2", tmp_path / "release")
    config = json.loads((tmp_path / "release" / "config.json").read_text())
    (tmp_path / "release" / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ConvertError, match=reason):
        convert_checkpoint(tmp_path / "release", tmp_path / "native")
    assert not (tmp_path / "native").exists()


TRAINING_WRAPPERS = {  # how training scripts save the same weights
    "lightning": lambda state: {"state_dict": {f"model.{k}": v for k, v in state.items()}, "epoch": 1},
    "compiled-ddp": lambda state: {f"module._orig_mod.{k}": v for k, v in state.items()},
    "model-entry": lambda state: {"model": state, "optimizer": {"lr": torch.tensor(1e-3)}, "step": 7},
}


@pytest.mark.parametrize("wrapper", sorted(TRAINING_WRAPPERS))
@torch.inference_mode()
def test_a_training_checkpoint_of_the_release_converts_to_the_same_model(wrapper: str, tmp_path: Path) -> None:
    """A Lightning ``{"state_dict": ...}`` with ``model.`` names, a compiled model under DDP (``module._orig_mod.``)
    and a ``{"model": ..., "optimizer": ...}`` dict give the release's weights; the notes say what was unwrapped."""
    reference = authors_release("mamba", tmp_path / "release", TRAINING_WRAPPERS[wrapper])
    checkpoint = convert_checkpoint(tmp_path / "release", tmp_path / "native")
    assert any("entry" in n or "prefix" in n for n in checkpoint.notes)
    model, _ = load_model(str(tmp_path / "native"), device="cpu", dtype="float32")
    for name, tensor in reference.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], tensor, atol=0, rtol=0)


def test_a_release_with_an_ema_copy_is_refused_naming_it(tmp_path: Path) -> None:
    authors_release("mamba", tmp_path / "release", lambda state: {**state, **{f"ema.{k}": v for k, v in state.items()}})
    with pytest.raises(ConvertError, match="EMA copy"):
        convert_checkpoint(tmp_path / "release", tmp_path / "native")
    assert not (tmp_path / "native").exists()


@torch.inference_mode()
def test_mamba2s_gated_norm_keeps_mamba_ssms_eps_whatever_norm_epsilon_says(tmp_path: Path) -> None:
    """``mamba_ssm``'s Mamba2 builds its gated RMSNorm with eps 1e-5 and uses ``norm_epsilon`` for the block norms
    only (``transformers`` takes ``layer_norm_epsilon`` for both): the reference here is ``transformers`` with the
    release's block eps and its mixers' norms set back to 1e-5."""
    reference = authors_release("mamba2", tmp_path / "release")
    release = json.loads((tmp_path / "release" / "config.json").read_text())
    (tmp_path / "release" / "config.json").write_text(json.dumps({**release, "norm_epsilon": 0.1}))
    for block in reference.backbone.layers:
        block.norm.variance_epsilon = 0.1
        block.mixer.norm.variance_epsilon = 1e-5
    reference.backbone.norm_f.variance_epsilon = 0.1
    convert_checkpoint(tmp_path / "release", tmp_path / "native")
    model, _ = load_model(str(tmp_path / "native"), device="cpu", dtype="float32")
    prompt = prompts(64, [23])[0]
    ours = model.prefill(PrefillBatch.build([prompt], [0]), StatePool(model.state_spec(), 1).tensors)[0]
    torch.testing.assert_close(ours, reference(torch.tensor([prompt])).logits[0, -1].float(), atol=1e-4, rtol=0)


# Every keyword argument of mamba_ssm's Mamba / Mamba2 constructors that ssm_cfg may set, at the constructor's
# default: a release that writes its ssm_cfg out in full converts to the model of an empty ssm_cfg.
MAMBA1_SSM_CFG_DEFAULTS = {
    "d_state": 16, "d_conv": 4, "expand": 2, "dt_rank": "auto", "dt_min": 0.001, "dt_max": 0.1, "dt_init": "random",
    "dt_scale": 1.0, "dt_init_floor": 1e-4, "conv_bias": True, "bias": False, "use_fast_path": True,
}
MAMBA2_SSM_CFG_DEFAULTS = {
    "d_state": 128, "d_conv": 4, "conv_init": None, "expand": 2, "headdim": 64, "d_ssm": None, "ngroups": 1,
    "A_init_range": [1, 16], "D_has_hdim": False, "rmsnorm": True, "norm_before_gate": False, "dt_min": 0.001,
    "dt_max": 0.1, "dt_init_floor": 1e-4, "dt_limit": [0.0, math.inf], "bias": False, "conv_bias": True,
    "chunk_size": 256, "use_mem_eff_path": True, "process_group": None, "sequence_parallel": True,
}  # fmt: skip


@pytest.mark.parametrize(
    ("layer", "full", "tuned"),
    [
        ("Mamba1", MAMBA1_SSM_CFG_DEFAULTS, {"dt_min": 0.01, "dt_init": "constant", "use_fast_path": False}),
        ("Mamba2", MAMBA2_SSM_CFG_DEFAULTS, {"dt_min": 0.01, "A_init_range": [1, 4], "chunk_size": 64}),
    ],
)
def test_every_constructor_argument_of_mamba_ssm_is_accepted(layer: str, full: dict, tuned: dict) -> None:
    """Initialisation and kernel settings (``tuned``) have no effect on a trained model: read and left behind."""
    release = {"d_model": 128, "n_layer": 2, "vocab_size": 64}
    _, empty = hf_config({**release, "ssm_cfg": {"layer": layer}}, 64)
    assert hf_config({**release, "ssm_cfg": {"layer": layer, **full}}, 64)[1] == empty
    assert hf_config({**release, "ssm_cfg": {"layer": layer, **full, **tuned}}, 64)[1] == empty


@pytest.mark.parametrize(
    ("ssm_cfg", "message"),
    [
        ({"d_stat": 8}, r"ssm_cfg keys \['d_stat'\] not arguments of mamba_ssm's Mamba1"),
        ({"d_state": 8, "headdim": 16}, r"\['headdim'\] not arguments of mamba_ssm's Mamba1"),  # Mamba-2's key
        ({"layer": "Mamba2", "dt_rank": 4}, r"\['dt_rank'\] not arguments of mamba_ssm's Mamba2"),  # Mamba-1's key
        ({"layer": "Mamba2", "headdim": 16, "layer_idx": 0}, r"\['layer_idx'\] set by mamba_ssm itself"),
        ({"dtype": "float16"}, r"\['dtype'\] set by mamba_ssm itself"),
        ({"layer": "Mamba2", "headdim": 16, "process_group": "nccl"}, "a tensor-parallel process_group"),
    ],
)
def test_ssm_cfg_keys_mamba_ssm_would_refuse_are_refused_naming_them(
    ssm_cfg: dict, message: str, tmp_path: Path
) -> None:
    """An unknown key used to be dropped without a word: a typo (``d_stat``) converted a model of the default
    size, and a fork's key whose effect rnnserve cannot know converted to a model that is not the one trained."""
    case = "mamba2" if ssm_cfg.get("layer") == "Mamba2" else "mamba"
    authors_release(case, tmp_path / "release")
    config = json.loads((tmp_path / "release" / "config.json").read_text())
    (tmp_path / "release" / "config.json").write_text(json.dumps({**config, "ssm_cfg": ssm_cfg}))
    with pytest.raises(ConvertError, match=message) as refused:
        convert_checkpoint(tmp_path / "release", tmp_path / "native")
    assert "config.json" in str(refused.value) and "not a mamba_ssm config" not in str(refused.value)
    assert not (tmp_path / "native").exists()


MAMBA2_SSM_CFG = {"layer": "Mamba2", "d_state": 16, "headdim": 16, "ngroups": 2}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"bidirectional": True}, r"keys \['bidirectional'\] are not fields of mamba_ssm's MambaConfig"),  # a fork
        ({"rms_nrom": False}, r"keys \['rms_nrom'\] are not fields"),  # a typo: RMSNorm was converted
        ({"attn_layer_idx": [1], "attn_cfg": {"num_heads": 4}}, r"attention layers \(attn_layer_idx \[1\]\)"),
        ({"d_intermediate": 64}, r"MLP blocks \(d_intermediate 64\)"),
        ({"rms_norm": False}, r"LayerNorm \(rms_norm False\)"),
        ({"pad_vocab_size_multiple": 7}, "the embedding has 64 rows, but vocab_size 60 padded to "
                                         "pad_vocab_size_multiple 7 is 63"),
        ({"vocab_size": 50}, "vocab_size 50 padded to pad_vocab_size_multiple 16 is 64"),  # 50 -> 64: accepted
        ({"vocab_size": 40}, "vocab_size 40 padded to pad_vocab_size_multiple 16 is 48"),
        ({"fused_add_norm": "fast"}, "fused_add_norm must be true or false, got 'fast'"),
        ({"ssm_cfg": {**MAMBA2_SSM_CFG, "layer": "Mamba3"}}, r"the mixer layer 'Mamba3' \(ssm_cfg.layer"),
        ({"ssm_cfg": {**MAMBA2_SSM_CFG, "d_ssm": 32}}, r"other than the inner width 64 \(ssm_cfg.d_ssm 32\)"),
        ({"ssm_cfg": {**MAMBA2_SSM_CFG, "norm_before_gate": True}}, "ssm_cfg.norm_before_gate True"),
        ({"ssm_cfg": {**MAMBA2_SSM_CFG, "rmsnorm": "false"}}, "ssm_cfg.rmsnorm 'false'"),
        ({"ssm_cfg": {**MAMBA2_SSM_CFG, "D_has_hdim": True}}, "ssm_cfg.D_has_hdim True"),
    ],
)
def test_each_config_key_mamba_ssm_reads_is_honoured_or_refused_naming_key_and_value(
    change: dict, message: str, tmp_path: Path
) -> None:
    """Every top-level key of a release is one of ``MambaConfig``'s fields (``MambaConfig(**config)`` refuses any
    other): an unknown key used to be dropped, converting a fork's bidirectional model or a typo as the plain model."""
    authors_release("mamba2", tmp_path / "release")
    config = json.loads((tmp_path / "release" / "config.json").read_text())
    (tmp_path / "release" / "config.json").write_text(json.dumps({**config, **change}))
    if change == {"vocab_size": 50}:
        assert convert_checkpoint(tmp_path / "release", tmp_path / "native").config["vocab_size"] == 64
        return
    with pytest.raises(ConvertError, match=message) as refused:
        convert_checkpoint(tmp_path / "release", tmp_path / "native")
    assert "config.json" in str(refused.value)
    assert not (tmp_path / "native").exists()


def test_keys_mamba_ssm_ignores_and_an_absent_padding_convert(tmp_path: Path) -> None:
    """``attn_cfg`` without attention layers, ``fused_add_norm`` (a kernel choice), mamba_ssm 1.0's
    ``initializer_cfg``, and no ``pad_vocab_size_multiple`` (8 in MambaConfig, 1 in mamba_ssm 1.0)."""
    authors_release("mamba", tmp_path / "release")
    config = json.loads((tmp_path / "release" / "config.json").read_text())
    del config["pad_vocab_size_multiple"]
    config |= {"attn_cfg": {"num_heads": 4}, "fused_add_norm": False, "initializer_cfg": {"initializer_range": 0.1}}
    (tmp_path / "release" / "config.json").write_text(json.dumps(config))
    assert convert_checkpoint(tmp_path / "release", tmp_path / "native").config["vocab_size"] == 64


def test_layer_norm_of_mamba_ssm_1_without_rms_norm_in_the_config_is_refused_naming_it(tmp_path: Path) -> None:
    """mamba_ssm 1.0 built LayerNorm when config.json had no ``rms_norm`` (later versions RMSNorm): the norms'
    biases tell them apart."""
    authors_release("mamba", tmp_path / "release", lambda state: {
        **state, **{k.replace(".weight", ".bias"): torch.zeros_like(v) for k, v in state.items()
                    if k.endswith(("norm.weight", "norm_f.weight"))}})  # fmt: skip
    config = json.loads((tmp_path / "release" / "config.json").read_text())
    del config["rms_norm"]
    (tmp_path / "release" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConvertError, match="LayerNorm \\(rms_norm absent, as in mamba_ssm 1.0"):
        convert_checkpoint(tmp_path / "release", tmp_path / "native")
