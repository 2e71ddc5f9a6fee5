"""``rnnserve convert --format looped``: the looped-transformer authors' training checkpoint (``kevin671/tmlt``,
a nanoGPT derivative) -> a native directory for :mod:`rnnserve.engine.models.looped`.

The source is ``ckpt.pt`` (or the training ``out_dir`` holding it): a dict with ``model`` (a state dict whose
keys start with ``_orig_mod.`` when training ran under ``torch.compile``), ``model_args`` (``n_loop, n_layer,
n_head, n_embd, block_size, bias, vocab_size, dropout``), ``config`` (the training script's settings, with
``model_type`` ``"lt"`` or ``"tmlt"``), ``iter_num``, ``best_val_loss`` and usually ``optimizer``. Only the
weights and the model shape are kept.

The authors' earlier ``model.py`` (commit 340f627) projected q, k and v with one fused ``c_attn`` (``[3 d, d]``, split
into q, k, v in that order along its output) and its plain ``lt`` block was pre-norm (``x += attn(norm(x))``,
``x += mlp(norm(x))``); ``tmlt`` computed what it computes now. A checkpoint with ``c_attn`` is split into ``q, k,
v`` exactly, and an ``lt`` one converts with ``prenorm_block``. The authors train on GPT-2 BPE but ship no tokenizer:
without ``--tokenizer`` the converted model serves token-id prompts (config ``"tokenizer": "token_ids"``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from rnnserve.engine.convert import ConvertedCheckpoint, ConvertError, load_pickled_tensors
from rnnserve.engine.models.base import config_bool
from rnnserve.engine.models.looped import shape_problem

COMPILE_PREFIX = "_orig_mod."
MODEL_TYPES = ("lt", "tmlt")
CHECKPOINT_NAME = "ckpt.pt"

SHARED_WEIGHTS = {
    "transformer.wte.weight": "embed.weight",
    "transformer.wpe.weight": "pos_embed.weight",
    "transformer.attn.q.weight": "block.q.weight",
    "transformer.attn.k.weight": "block.k.weight",
    "transformer.attn.v.weight": "block.v.weight",
    "transformer.attn.c_proj.weight": "block.o.weight",
    "transformer.mlp.c_fc.weight": "block.fc_in.weight",
    "transformer.mlp.c_proj.weight": "block.fc_out.weight",
    "transformer.ln_f.weight": "final_norm.weight",
}
BIASES = {
    "transformer.attn.q.bias": "block.q.bias",
    "transformer.attn.k.bias": "block.k.bias",
    "transformer.attn.v.bias": "block.v.bias",
    "transformer.attn.c_proj.bias": "block.o.bias",
    "transformer.mlp.c_fc.bias": "block.fc_in.bias",
    "transformer.mlp.c_proj.bias": "block.fc_out.bias",
}
TMLT_WEIGHTS = {
    "timestep_embedder.mlp.0.weight": "timestep_in.weight",
    "timestep_embedder.mlp.0.bias": "timestep_in.bias",
    "timestep_embedder.mlp.2.weight": "timestep_out.weight",
    "timestep_embedder.mlp.2.bias": "timestep_out.bias",
    "adaLN_modulation.1.weight": "modulation.weight",
    "adaLN_modulation.1.bias": "modulation.bias",
}
TIED_HEAD = "lm_head.weight"
FUSED_QKV = "transformer.attn.c_attn"  # the authors' earlier fused projection: rows q, then k, then v
CONFIG_KEYS = ("vocab_size", "n_embd", "n_head", "n_loop", "block_size", "bias")
# The defaults of the authors' ``Config`` dataclass (gpt.py), which their train.py builds from ``model_args``: a field
# the checkpoint's ``model_args`` lacks had this value in the model that was trained (the sizes are checked against
# the weights). Not n_loop: its default changed between the authors' versions (100 beside the train.py that did not
# save it, 6 now) and no weight's shape tells the two apart, so a checkpoint without it is refused.
AUTHORS_CONFIG_DEFAULTS = {"vocab_size": 50304, "n_embd": 768, "n_head": 12, "block_size": 1024, "bias": True,
                           "is_causal": True}  # fmt: skip


def _checkpoint_file(src: Path) -> Path:
    return src / CHECKPOINT_NAME if src.is_dir() else src


def detect(src: Path) -> bool:
    """A ``.pt`` file (or a directory with ``ckpt.pt``) holding ``model``, ``model_args`` and a ``config``
    whose ``model_type`` is ``lt`` or ``tmlt``."""
    path = _checkpoint_file(src)
    if path.suffix != ".pt" or not path.is_file():
        return False
    checkpoint = load_pickled_tensors(path)  # a .pt refused by weights_only=True is reported, not passed over
    if _model_type(checkpoint) not in MODEL_TYPES:
        return False
    global _detected
    _detected = (_file_key(path), checkpoint)
    return True


# The checkpoint detect() read, kept for the convert() that follows it: the file is read once, not twice.
_detected: tuple[tuple[str, int, int], Any] | None = None


def _file_key(path: Path) -> tuple[str, int, int]:
    stat = path.stat()
    return str(path.resolve()), stat.st_mtime_ns, stat.st_size


def _read_checkpoint(path: Path) -> Any:
    global _detected
    detected, _detected = _detected, None
    if detected is not None and detected[0] == _file_key(path):
        return detected[1]
    return load_pickled_tensors(path)


def _model_type(checkpoint: Any) -> str | None:
    if not isinstance(checkpoint, dict) or not {"model", "model_args", "config"} <= checkpoint.keys():
        return None
    config = checkpoint["config"]
    return config.get("model_type") if isinstance(config, dict) else None


def weight_names(model_type: str, bias: bool) -> dict[str, str]:
    """The authors' parameter names -> rnnserve's, for one model type."""
    names = dict(SHARED_WEIGHTS)
    if bias:
        names.update(BIASES)
    if model_type == "tmlt":
        names.update(TMLT_WEIGHTS)
    return names


def split_fused_qkv(state: dict[str, torch.Tensor], n_embd: int, path: Path) -> dict[str, torch.Tensor]:
    """``state`` with the fused ``c_attn`` weight (and bias) replaced by ``q, k, v`` as the authors' forward
    splits its output (``c_attn(x).split(n_embd, dim=2)``): rows ``[0, d)`` are q, ``[d, 2d)`` k, ``[2d, 3d)`` v."""
    state = dict(state)
    for kind in ("weight", "bias"):
        fused = state.pop(f"{FUSED_QKV}.{kind}", None)
        if fused is None:
            continue
        expected = (3 * n_embd, n_embd) if kind == "weight" else (3 * n_embd,)
        if tuple(fused.shape) != expected:
            raise ConvertError(
                f"{path}: {FUSED_QKV}.{kind} has shape {tuple(fused.shape)}, the fused q, k, v projection of width "
                f"n_embd {n_embd} is {expected}"
            )
        for name, part in zip("qkv", fused.split(n_embd, dim=0), strict=True):
            state[f"transformer.attn.{name}.{kind}"] = part.clone()
    return state


def convert(src: Path) -> ConvertedCheckpoint:
    """Read the authors' checkpoint and map it to the ``lt`` / ``tmlt`` architecture."""
    path = _checkpoint_file(src)
    checkpoint = _read_checkpoint(path)
    model_type = _model_type(checkpoint)
    if model_type not in MODEL_TYPES:
        raise ConvertError(
            f"{path}: not a looped-transformer checkpoint (needs 'model', 'model_args' and config['model_type'] "
            f"in {MODEL_TYPES}; found model_type {model_type!r})"
        )
    if not isinstance(checkpoint["model_args"], dict):
        raise ConvertError(f"{path}: model_args is a {type(checkpoint['model_args']).__name__}, not a dict")
    if "n_loop" not in checkpoint["model_args"]:
        raise ConvertError(
            f"{path}: model_args lacks n_loop, the number of loops, whose default differs between the authors' "
            "versions (100, later 6) and which the weights do not show: add it to model_args as the model was trained"
        )
    defaulted = {k: v for k, v in AUTHORS_CONFIG_DEFAULTS.items() if k not in checkpoint["model_args"]}
    args = {**defaulted, **checkpoint["model_args"]}
    problem = shape_problem(args)
    if problem is not None:
        raise ConvertError(f"{path}: model_args: {problem}")
    state = {k.removeprefix(COMPILE_PREFIX): v for k, v in checkpoint["model"].items()}
    head = state.pop(TIED_HEAD, None)
    if head is not None and not torch.equal(head, state.get("transformer.wte.weight", head)):
        raise ConvertError(f"{path}: {TIED_HEAD} differs from transformer.wte.weight (the models tie them)")
    try:
        bias = config_bool(args["bias"], "bias")
        causal = config_bool(args["is_causal"], "is_causal")
    except ValueError as err:
        raise ConvertError(f"{path}: model_args: {err}") from err
    if not causal:  # the authors' attention reads it: every position would see the whole sequence, later tokens too
        raise ConvertError(f"{path}: model_args: is_causal is false (bidirectional attention), not a decoder")
    fused = f"{FUSED_QKV}.weight" in state
    separate = ("transformer.attn.q.", "transformer.attn.k.", "transformer.attn.v.")
    if fused and any(k.startswith(separate) for k in state):
        raise ConvertError(
            f"{path}: holds both the fused {FUSED_QKV} projection (the authors' earlier model.py) and separate "
            "q, k, v projections (the current one): not a model of either version"
        )
    if fused:
        state = split_fused_qkv(state, args["n_embd"], path)
    names = weight_names(model_type, bias)
    missing = sorted(set(names) - state.keys())
    unexpected = sorted(state.keys() - names.keys())
    if missing or unexpected:
        raise ConvertError(
            f"{path}: {model_type} checkpoint with missing weights {missing}, unexpected {unexpected}; the layouts "
            f"supported are the authors' model.py with separate transformer.attn.q/k/v, or its earlier fused "
            f"{FUSED_QKV} (with biases when model_args bias is true)"
        )
    config = {"architecture": model_type, **{k: args[k] for k in CONFIG_KEYS}, "bias": bias, "tokenizer": "token_ids"}
    if fused and model_type == "lt":
        config["prenorm_block"] = True
    notes = [
        f"{model_type}: {args['n_loop']} loops of one block, width {args['n_embd']}, {args['n_head']} heads, "
        f"block_size {args['block_size']} (the longest sequence, prompt + generated tokens)",
        f"training step {checkpoint.get('iter_num')}, best validation loss {checkpoint.get('best_val_loss')}",
        "dropped: the optimizer state (if any), n_layer (unused by looped models), dropout (inference)",
        "prompts are token ids unless --tokenizer gives a tokenizer.json (the authors train on GPT-2 BPE)",
    ]
    if fused:
        block = ("; its lt block is pre-norm (q, k, v and the MLP input normalised): prenorm_block"
                 if model_type == "lt" else "")
        notes.append(f"fused {FUSED_QKV} of the authors' earlier model.py split into q, k, v{block}")
    if defaulted:
        notes.append(f"model_args lacks {sorted(defaulted)}: the authors' Config defaults, {defaulted}")
    return ConvertedCheckpoint(config, {names[k]: v for k, v in state.items()}, notes=notes)
