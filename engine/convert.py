"""``rnnserve convert SRC DEST``: turn a checkpoint an architecture's authors released in a pickled training
format into a native rnnserve directory (``config.json`` + ``model.safetensors`` [+ ``tokenizer.json``]).

Each format is a :class:`Converter` naming a module (imported only when used) with two functions:
``detect(src: Path) -> bool`` and ``convert(src: Path) -> ConvertedCheckpoint``. Pickles are read only
through :func:`load_pickled_tensors` (``torch.load(weights_only=True)``), which never runs pickled code.
"""

from __future__ import annotations

import importlib
import json
import os
import pickle
import re
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from safetensors.torch import save_file


class ConvertError(ValueError):
    """A source that cannot be converted, with the reason in words."""


@dataclass(frozen=True)
class Converter:
    """A checkpoint format: its name (``--format``), one line of description and its module."""

    name: str
    description: str
    module: str

    def load(self) -> ModuleType:
        return importlib.import_module(self.module)


@dataclass
class ConvertedCheckpoint:
    """What a converter produces: the native ``config.json`` values (with ``architecture``), the tensors
    under the model's parameter names, the source's own ``tokenizer.json`` if it has one, and notes for
    the user (e.g. dropped training-only entries)."""

    config: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    tokenizer_json: Path | None = None
    notes: list[str] = field(default_factory=list)


CONVERTERS: dict[str, Converter] = {}


def register_converter(name: str, description: str, module: str) -> None:
    """Make ``--format name`` (and auto-detection) use ``module``'s ``detect`` and ``convert``."""
    if name in CONVERTERS:
        raise ValueError(f"converter {name!r} registered twice")
    CONVERTERS[name] = Converter(name, description, module)


register_converter(
    "looped", "looped transformers' ckpt.pt (kevin671/tmlt: lt, tmlt)", "rnnserve.engine.models.looped_checkpoint"
)
register_converter(
    "based", "Based authors' pytorch_model.bin directory (HazyResearch/based)",
    "rnnserve.engine.models.based_checkpoint",
)
register_converter(
    "mamba_ssm", "the Mamba authors' mamba_ssm release directory (state-spaces/mamba-*, mamba2-*)",
    "rnnserve.engine.models.mamba_ssm_checkpoint",
)


def load_pickled_tensors(path: Path) -> Any:
    """Read a pickled checkpoint with ``torch.load(weights_only=True)``: tensors, containers and plain
    values only; anything else (code, custom classes) is refused with a :class:`ConvertError`."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError as err:
        raise ConvertError(f"{path}: no such file") from err
    except Exception as err:  # torch raises UnpicklingError, RuntimeError or others for unsafe or bad files
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        if isinstance(err, pickle.UnpicklingError) and "weights_only" in str(err):  # not torch's advice to unpickle
            found = re.search(r"GLOBAL (\S+)", str(err))
            reason = f"it holds code or a class ({found[1] if found else 'not a tensor'}), which is never loaded"
        raise ConvertError(f"{path}: not a plain tensor checkpoint (refused by weights_only=True): {reason}") from err


# Where training scripts keep the weights in a checkpoint: PyTorch Lightning, common scripts, nanoGPT, DeepSpeed.
WRAPPER_ENTRIES = ("state_dict", "model_state_dict", "model", "module")
# Prefixes a whole state dict gets from its training wrapper: torch.compile, (Distributed)DataParallel, and the
# attribute a LightningModule keeps its model under.
WRAPPER_PREFIXES = ("_orig_mod.", "module.", "model.")
# Names an exponential moving average of the weights goes by, as an entry beside the weights or a key prefix.
EMA_NAMES = ("ema", "model_ema", "ema_model", "state_dict_ema", "ema_state_dict")


def _is_state_dict(value: Any) -> bool:
    return isinstance(value, dict) and bool(value) and all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in value.items()
    )


def training_state_dict(payload: Any, file: Path) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The weights of a pickled checkpoint and notes on where they were: a state dict as ``model.state_dict()``
    gives it, or one under a training wrapper's entry (``state_dict``, ``model``, ...), with the prefix a wrapper
    gives every name (``_orig_mod.``, ``module.``, ``model.``) removed. A checkpoint that also holds an EMA copy
    of the weights is refused: which of the two to serve is the user's choice, not a guess."""
    notes: list[str] = []
    state = payload
    if isinstance(payload, dict) and not _is_state_dict(payload):
        entry = next((k for k in WRAPPER_ENTRIES if _is_state_dict(payload.get(k))), None)
        if entry is None:
            keys = sorted(str(k) for k in payload)
            raise ConvertError(
                f"{file}: no state dict of tensors, neither at the top level nor under one of {list(WRAPPER_ENTRIES)} "
                f"(top-level keys: {keys[:8]}{' ...' if len(keys) > 8 else ''})"
            )
        ema = [k for k in EMA_NAMES if payload.get(k) is not None]
        if ema:
            raise ConvertError(
                f"{file}: holds the weights under {entry!r} and an EMA copy under {ema[0]!r}; save the one to serve "
                "as a plain state dict (torch.save(checkpoint[name], path)) and convert that"
            )
        state = payload[entry]
        notes.append(f"weights from the checkpoint's {entry!r} entry")
    elif not _is_state_dict(payload):
        raise ConvertError(f"{file}: expected a state dict (names -> tensors), got {type(payload).__name__}")
    ema_keys = sorted(k for k in state if k.split(".", 1)[0] in EMA_NAMES)
    if ema_keys:
        raise ConvertError(
            f"{file}: holds an EMA copy of the weights beside them ({ema_keys[0]}, ...); save the one to serve as a "
            "plain state dict and convert that"
        )
    while (prefix := next((p for p in WRAPPER_PREFIXES if all(k.startswith(p) for k in state)), None)) is not None:
        state = {k.removeprefix(prefix): v for k, v in state.items()}
        notes.append(f"removed the prefix {prefix!r} of every weight name")
    return state, notes


def read_config(src: Path) -> dict[str, Any] | None:
    """``src/config.json`` as a dict, or ``None`` where there is none that reads as a JSON object (a converter's
    ``detect`` asks, and ``convert`` refuses)."""
    path = src / "config.json"
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def find_converter(src: Path, name: str | None = None) -> Converter:
    """The converter named ``name``, or the one whose ``detect`` accepts ``src``."""
    if name is not None:
        if name not in CONVERTERS:
            raise ConvertError(f"unknown format {name!r}; known: {', '.join(sorted(CONVERTERS))}")
        return CONVERTERS[name]
    for converter in CONVERTERS.values():
        if converter.load().detect(src):
            return converter
    raise ConvertError(
        f"{src}: no converter recognises it; known formats: "
        + "; ".join(f"{c.name} ({c.description})" for c in CONVERTERS.values())
    )


# What write_native_checkpoint puts in a directory: all that --force may delete.
NATIVE_CHECKPOINT_FILES = frozenset({"config.json", "model.safetensors", "tokenizer.json"})


def write_native_checkpoint(
    dest: Path, checkpoint: ConvertedCheckpoint, tokenizer_json: Path | None = None, overwrite: bool = False
) -> None:
    """Write ``checkpoint`` to the directory ``dest`` atomically: it appears whole or not at all. ``overwrite``
    replaces a checkpoint this function wrote before, never a directory holding other files."""
    if dest.exists() and any(dest.iterdir()):
        if not overwrite:
            raise ConvertError(f"{dest} exists and is not empty (pass --force to replace it)")
        foreign = sorted(p.name for p in dest.iterdir() if p.name not in NATIVE_CHECKPOINT_FILES or not p.is_file())
        if foreign:
            shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
            raise ConvertError(
                f"{dest} holds files a converted checkpoint does not ({shown}): --force replaces only a "
                "checkpoint written by convert; choose a new or empty directory"
            )
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        (staging / "config.json").write_text(json.dumps(checkpoint.config, indent=2) + "\n")
        tensors = {name: t.detach().contiguous().cpu() for name, t in checkpoint.tensors.items()}
        save_file(tensors, str(staging / "model.safetensors"))
        if tokenizer_json is not None:
            shutil.copyfile(tokenizer_json, staging / "tokenizer.json")
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(staging, dest)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def convert_checkpoint(
    src: str | Path,
    dest: str | Path,
    format_name: str | None = None,
    tokenizer_json: str | Path | None = None,
    overwrite: bool = False,
    allow_non_finite: bool = False,
) -> ConvertedCheckpoint:
    """Convert ``src`` (format detected unless named) into a native checkpoint directory ``dest``. A tensor holding
    NaN or infinite numbers (a training run that diverged, a corrupt file) is refused, naming it, unless
    ``allow_non_finite``."""
    src, dest = Path(src).expanduser(), Path(dest).expanduser()
    if not src.exists():
        raise ConvertError(f"{src}: no such file or directory")
    if dest.resolve() == src.resolve() or dest.resolve() in src.resolve().parents:
        raise ConvertError(f"{dest} is or contains the source {src}: writing it would delete the source")
    if dest.exists() and not dest.is_dir():
        raise ConvertError(f"{dest} exists and is not a directory")
    tokenizer = Path(tokenizer_json).expanduser() if tokenizer_json is not None else None
    if tokenizer is not None and not tokenizer.is_file():
        raise ConvertError(f"{tokenizer}: no such tokenizer file")
    converter = find_converter(src, format_name).load()
    try:
        checkpoint = converter.convert(src)
    except ConvertError:
        raise
    except Exception as err:  # values the format does not allow (n_head 0, a list where a dict belongs)
        raise ConvertError(f"{src}: cannot convert it: {type(err).__name__}: {err}") from err
    if "architecture" not in checkpoint.config:
        raise ConvertError("converter produced a config without 'architecture'")
    _check_loadable(checkpoint, src, tokenizer)
    _check_finite(checkpoint, src, allow_non_finite)
    try:
        write_native_checkpoint(dest, checkpoint, tokenizer or checkpoint.tokenizer_json, overwrite)
    except OSError as err:
        raise ConvertError(f"{dest}: cannot write it: {err}") from err
    return checkpoint


def _check_loadable(checkpoint: ConvertedCheckpoint, src: Path, tokenizer: Path | None) -> None:
    """What ``load_model`` would refuse in the written directory is refused before it is written: weights
    that are not the architecture's (a row short, transposed), and a tokenizer file that is none."""
    from rnnserve.engine.loader import check_native_weights, read_hf_tokenizer
    from rnnserve.engine.model_sources import ModelLoadError
    from rnnserve.engine.models import MODEL_REGISTRY

    try:
        if checkpoint.config["architecture"] in MODEL_REGISTRY:  # else load_model names it
            check_native_weights(checkpoint.config, checkpoint.tensors, src)
        if tokenizer is not None:
            read_hf_tokenizer(tokenizer)
    except ModelLoadError as err:
        raise ConvertError(str(err)) from err


def _check_finite(checkpoint: ConvertedCheckpoint, src: Path, allow: bool) -> None:
    """Every floating tensor is finite: a model with a NaN weight converted, loaded and then answered every request
    with NaN logits (a diverged training run's last checkpoint often holds them). With ``allow`` each such tensor
    is a note instead."""
    from rnnserve.engine.loader import non_finite_summary

    for name, tensor in checkpoint.tensors.items():
        found = non_finite_summary(tensor)
        if found is None:
            continue
        if not allow:
            raise ConvertError(
                f"{src}: tensor {name} holds {found}; a model with it would compute NaN. Convert a checkpoint "
                "from before training diverged, or pass --allow-non-finite to convert it as it is"
            )
        checkpoint.notes.append(f"{name} holds {found} (kept: --allow-non-finite)")


def describe(checkpoint: ConvertedCheckpoint) -> Mapping[str, Any]:
    """A short summary for the command line: architecture, tensor count and parameter count."""
    return {
        "architecture": checkpoint.config["architecture"],
        "tensors": len(checkpoint.tensors),
        "parameters": sum(t.numel() for t in checkpoint.tensors.values()),
    }
