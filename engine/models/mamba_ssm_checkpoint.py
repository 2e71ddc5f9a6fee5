"""``rnnserve convert --format mamba_ssm``: a release of the Mamba authors' own package (``state-spaces/mamba``,
as on state-spaces/mamba-130m or mamba2-2.7b: a ``config.json`` with ``d_model``, ``n_layer`` and ``ssm_cfg``, and
``pytorch_model.bin``) -> a native rnnserve ``mamba`` or ``mamba2`` directory.

The config maps onto the fields ``transformers``' conversion writes (``ssm_cfg["layer"]`` picks Mamba-1 or
Mamba-2; unset ``ssm_cfg`` entries take ``mamba_ssm``'s defaults), and the weights keep their names but for
``backbone.embedding`` -> ``backbone.embeddings``. The vocabulary is the embedding's rows (``mamba_ssm`` pads
``vocab_size`` to ``pad_vocab_size_multiple``). The releases carry no tokenizer (the authors use GPT-NeoX-20B's):
pass ``--tokenizer``, else prompts are token ids. What the native models do not compute is refused: hybrid
attention layers, MLP blocks (``d_intermediate``), LayerNorm instead of RMSNorm, Mamba-2 without its gated norm
or with ``d_ssm`` below the inner width. ``ssm_cfg`` keys are the keyword arguments of ``mamba_ssm``'s ``Mamba`` /
``Mamba2`` constructors; any other key is refused, as ``mamba_ssm`` itself refuses it. The top-level keys are
``MambaConfig``'s fields (:data:`TOP_LEVEL_KEYS`); any other is refused too (``MambaConfig(**config)`` raises on it),
so a fork's extension (``bidirectional``) or a typo (``rms_nrom``) is never converted as the plain model.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from rnnserve.engine.convert import (
    ConvertedCheckpoint,
    ConvertError,
    load_pickled_tensors,
    read_config,
    training_state_dict,
)
from rnnserve.engine.models.base import config_bool
from rnnserve.engine.models.mamba import MambaLM
from rnnserve.engine.models.mamba2 import Mamba2Config, Mamba2LM

WEIGHTS = "pytorch_model.bin"
EMBEDDING = ("backbone.embedding.weight", "backbone.embeddings.weight")  # mamba_ssm's name, the native one
HEAD = "lm_head.weight"
LAYER_NORM_BIASES = (".norm.bias", "norm_f.bias")  # nn.LayerNorm's; mamba_ssm's RMSNorm has no bias
MAMBA_SSM_GATED_NORM_EPS = 1e-5  # mamba_ssm's Mamba2 builds its RMSNormGated with eps=1e-5 whatever the config says


# ssm_cfg is passed to mamba_ssm's mixer constructor as keyword arguments (modules/mamba_simple.py ``Mamba``,
# modules/mamba2.py ``Mamba2``): these are the keys each accepts, by what rnnserve does with them.
SSM_CFG_KEYS = {
    "Mamba1": {
        "read": {"d_state", "d_conv", "expand", "dt_rank", "bias", "conv_bias"},
        # the random initialisation and the training kernel's choice: no effect on a trained model's output
        "ignored": {"dt_min", "dt_max", "dt_init", "dt_scale", "dt_init_floor", "use_fast_path"},
    },
    "Mamba2": {
        "read": {"d_state", "d_conv", "expand", "headdim", "d_ssm", "ngroups", "D_has_hdim", "rmsnorm",
                 "norm_before_gate", "dt_limit", "bias", "conv_bias", "process_group"},
        # initialisation, the training kernel's path, the SSD chunk length (the same sums grouped otherwise) and
        # tensor-parallel sequence sharding (only with a process group, which must be null here)
        "ignored": {"conv_init", "A_init_range", "dt_min", "dt_max", "dt_init_floor", "chunk_size",
                    "use_mem_eff_path", "sequence_parallel"},
    },
}  # fmt: skip
# Arguments mamba_ssm passes to the mixer itself: in ssm_cfg they are a "got multiple values" TypeError there.
SSM_CFG_SET_BY_MAMBA_SSM = ("d_model", "layer_idx", "device", "dtype")
# config.json's keys: the fields of mamba_ssm's MambaConfig (models/config_mamba.py), which from_pretrained builds
# with MambaConfig(**config) and so refuses any other key; plus the two keyword arguments mamba_ssm 1.0's
# MambaLMHeadModel(**config) also passed on: norm_epsilon (the block and final norms' eps, read) and
# initializer_cfg (initialisation only, left behind).
TOP_LEVEL_KEYS = {
    "read": {"d_model", "d_intermediate", "n_layer", "vocab_size", "ssm_cfg", "attn_layer_idx", "rms_norm",
             "residual_in_fp32", "pad_vocab_size_multiple", "tie_embeddings", "norm_epsilon"},
    # attn_cfg configures attention layers (only read with attn_layer_idx, which is refused); fused_add_norm picks
    # Triton's fused residual add + norm, the same sums as the unfused path
    "ignored": {"attn_cfg", "fused_add_norm", "initializer_cfg"},
}  # fmt: skip


def check_top_level_keys(config: dict[str, Any]) -> None:
    """ConvertError naming the ``config.json`` keys that are not ``mamba_ssm``'s (see :data:`TOP_LEVEL_KEYS`)."""
    known = TOP_LEVEL_KEYS["read"] | TOP_LEVEL_KEYS["ignored"]
    unknown = sorted(k for k in config if k not in known)
    if unknown:
        raise ConvertError(
            f"keys {unknown} are not fields of mamba_ssm's MambaConfig (it has {sorted(known)}): a fork's extension "
            "or a typo, whose effect on the model rnnserve cannot know"
        )


def padded_vocab_size(vocab_size: int, multiple: int) -> int:
    """``vocab_size`` rounded up to a multiple of ``multiple``, as ``MambaLMHeadModel`` sizes its embedding."""
    return vocab_size + (-vocab_size % multiple)


def check_ssm_cfg_keys(cfg: dict[str, Any], layer: str) -> None:
    """ConvertError naming the ``ssm_cfg`` keys that ``mamba_ssm``'s ``layer`` constructor would refuse: unknown ones
    (a typo, a key of the other Mamba version, a fork's extension whose effect rnnserve cannot know) and the
    arguments ``mamba_ssm`` sets itself."""
    known = SSM_CFG_KEYS[layer]["read"] | SSM_CFG_KEYS[layer]["ignored"]
    reserved = sorted(k for k in cfg if k in SSM_CFG_SET_BY_MAMBA_SSM)
    unknown = sorted(k for k in cfg if k not in known and k not in SSM_CFG_SET_BY_MAMBA_SSM)
    problems = []
    if unknown:
        problems.append(f"{unknown} not arguments of mamba_ssm's {layer} (it accepts {sorted(known)})")
    if reserved:
        problems.append(f"{reserved} set by mamba_ssm itself for every layer, not by ssm_cfg")
    if problems:
        raise ConvertError(f"ssm_cfg keys {'; keys '.join(problems)}")


def detect(src: Path) -> bool:
    """A directory with ``pytorch_model.bin`` and a ``mamba_ssm`` config (``d_model``, ``n_layer``, no
    ``model_type``)."""
    config = read_config(src) if src.is_dir() else None
    return (
        config is not None and (src / WEIGHTS).is_file() and "model_type" not in config
        and {"d_model", "n_layer", "vocab_size"} <= config.keys()
    )  # fmt: skip


def hf_config(
    ssm: dict[str, Any], vocab_size: int, layer_norm_biases: bool = False
) -> tuple[type[MambaLM] | type[Mamba2LM], dict[str, Any]]:
    """The architecture and the ``transformers``-style config a ``mamba_ssm`` config describes, for weights whose
    embedding has ``vocab_size`` rows (and, with ``layer_norm_biases``, whose block norms have biases: LayerNorm)."""
    check_top_level_keys(ssm)
    cfg = dict(ssm.get("ssm_cfg") or {})
    layer = cfg.pop("layer", "Mamba1")
    multiple = ssm.get("pad_vocab_size_multiple")
    # absent: 8 in MambaConfig, 1 in mamba_ssm 1.0 (its MambaLMHeadModel's default); either padding is the release's
    paddings = {padded_vocab_size(int(ssm["vocab_size"]), m) for m in ((1, 8) if multiple is None else (multiple,))}
    if vocab_size not in paddings:
        shown = "absent (1 or 8)" if multiple is None else multiple
        raise ConvertError(
            f"the embedding has {vocab_size} rows, but vocab_size {ssm['vocab_size']} padded to "
            f"pad_vocab_size_multiple {shown} is {' or '.join(map(str, sorted(paddings)))}: the config is not the "
            "weights' model"
        )
    config_bool(ssm.get("fused_add_norm", True), "fused_add_norm")  # a kernel choice, but a boolean in mamba_ssm
    rms_norm = ssm.get("rms_norm")
    refused = [
        (bool(ssm.get("attn_layer_idx")), f"attention layers (attn_layer_idx {ssm.get('attn_layer_idx')!r})"),
        (bool(ssm.get("d_intermediate", 0)), f"MLP blocks (d_intermediate {ssm.get('d_intermediate')!r})"),
        (rms_norm is not None and not config_bool(rms_norm, "rms_norm"), f"LayerNorm (rms_norm {rms_norm!r})"),
        # mamba_ssm 1.0 built LayerNorm when config.json had no rms_norm, later versions RMSNorm: the biases tell
        (rms_norm is None and layer_norm_biases, "LayerNorm (rms_norm absent, as in mamba_ssm 1.0, whose default is "
         "LayerNorm, and the norms have biases)"),
        (layer not in ("Mamba1", "Mamba2"), f"the mixer layer {layer!r} (ssm_cfg.layer; mamba_ssm has Mamba1 and "
         "Mamba2)"),
    ]  # fmt: skip
    if layer in SSM_CFG_KEYS:
        check_ssm_cfg_keys(cfg, layer)
    d_model = int(ssm["d_model"])
    common = {
        "vocab_size": vocab_size, "hidden_size": d_model, "num_hidden_layers": int(ssm["n_layer"]),
        "expand": cfg.get("expand", 2), "conv_kernel": cfg.get("d_conv", 4),
        "use_bias": config_bool(cfg.get("bias", False), "ssm_cfg.bias"),
        "use_conv_bias": config_bool(cfg.get("conv_bias", True), "ssm_cfg.conv_bias"),
        "layer_norm_epsilon": ssm.get("norm_epsilon", 1e-5),
        "residual_in_fp32": config_bool(ssm.get("residual_in_fp32", True), "residual_in_fp32"),
        "tie_word_embeddings": config_bool(ssm.get("tie_embeddings", True), "tie_embeddings"),
    }  # fmt: skip
    if layer == "Mamba2":
        d_inner = int(cfg.get("expand", 2) * d_model)
        head_dim = cfg.get("headdim", 64)
        refused += [
            (not config_bool(cfg.get("rmsnorm", True), "ssm_cfg.rmsnorm"),
             f"Mamba-2 without its gated RMSNorm (ssm_cfg.rmsnorm {cfg.get('rmsnorm')!r})"),
            (config_bool(cfg.get("norm_before_gate", False), "ssm_cfg.norm_before_gate"),
             f"the norm before the gate (ssm_cfg.norm_before_gate {cfg.get('norm_before_gate')!r})"),
            (cfg.get("d_ssm") not in (None, d_inner),
             f"an SSM width other than the inner width {d_inner} (ssm_cfg.d_ssm {cfg.get('d_ssm')!r})"),
            (config_bool(cfg.get("D_has_hdim", False), "ssm_cfg.D_has_hdim"),
             f"a D per channel (ssm_cfg.D_has_hdim {cfg.get('D_has_hdim')!r})"),
            (cfg.get("process_group") is not None,
             f"a tensor-parallel process_group (ssm_cfg.process_group {cfg.get('process_group')!r})"),
        ]
        low, high = cfg.get("dt_limit", (0.0, math.inf))
        hf = {**common, "model_type": "mamba2", "num_heads": d_inner // head_dim, "head_dim": head_dim,
              "state_size": cfg.get("d_state", 128), "n_groups": cfg.get("ngroups", 1),
              "time_step_limit": (low, high)}  # fmt: skip
    else:
        hf = {**common, "model_type": "mamba", "state_size": cfg.get("d_state", 16),
              "time_step_rank": cfg.get("dt_rank", "auto")}  # fmt: skip
    reasons = [reason for refuse, reason in refused if refuse]
    if reasons:
        raise ConvertError(f"this mamba_ssm model has {', '.join(reasons)}, which rnnserve's Mamba models do not")
    return (Mamba2LM if layer == "Mamba2" else MambaLM), hf


def convert(src: Path) -> ConvertedCheckpoint:
    """Read ``config.json`` and ``pytorch_model.bin`` (tensors only) and map them to the native layout."""
    ssm = read_config(src)
    if ssm is None:
        raise ConvertError(f"{src}: no readable config.json")
    state, unwrapped = training_state_dict(load_pickled_tensors(src / WEIGHTS), src / WEIGHTS)
    if EMBEDDING[0] not in state:
        raise ConvertError(f"{src / WEIGHTS}: no {EMBEDDING[0]} (names start with {sorted(state)[:3]})")
    try:
        biases = any(key.endswith(LAYER_NORM_BIASES) for key in state)
        cls, hf = hf_config(ssm, int(state[EMBEDDING[0]].shape[0]), biases)
        config = cls.from_hf_config(hf)
        if isinstance(config, Mamba2Config):  # mamba_ssm's gated norm ignores norm_epsilon; transformers' takes it
            config.gated_norm_eps = MAMBA_SSM_GATED_NORM_EPS
    except ConvertError as err:  # a config rnnserve understands and refuses, with the reason
        raise ConvertError(f"{src / 'config.json'}: {err}") from err
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as err:
        raise ConvertError(f"{src / 'config.json'}: not a mamba_ssm config: {type(err).__name__}: {err}") from err
    tensors = {EMBEDDING[1] if key == EMBEDDING[0] else key: value for key, value in state.items()}
    padded = f"vocabulary of {hf['vocab_size']} rows (config.json's vocab_size {ssm['vocab_size']}, padded)"
    notes = [*unwrapped, padded]
    if config.tie_embeddings and HEAD in tensors:
        if not torch.equal(tensors[HEAD], tensors[EMBEDDING[1]]):
            raise ConvertError(f"{src / WEIGHTS}: tie_embeddings is set but {HEAD} differs from {EMBEDDING[0]}")
        del tensors[HEAD]
        notes.append("tied embedding stored once")
    native = {"architecture": cls.architecture, **config.to_dict(), "tokenizer": "token_ids"}  # unless --tokenizer
    return ConvertedCheckpoint(config=native, tensors=tensors, notes=notes)
