"""Model loading: ``random:<preset>``, registered name prefixes (e.g. ``lsrl:``) and checkpoint directories.

A checkpoint directory holds ``config.json`` (with ``architecture``), one or more ``*.safetensors`` files
and, unless the model is byte-level, ``tokenizer.json``. Weights are read with safetensors only: pickle
files (``*.bin``, ``*.pt``, ...) are never opened.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from engine.lsrl.builtins import load_builtin
from engine.models import MODEL_REGISTRY, PRESETS, RecurrentLM
from engine.tokenizer import ByteTokenizer, CharTokenizer, HFTokenizer, Tokenizer

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")


class ModelLoadError(ValueError):
    """A model could not be loaded; the message names the problem in one line."""


Loaded = tuple[RecurrentLM, Tokenizer]
ModelSource = Callable[[str, torch.device, torch.dtype | None], Loaded]
MODEL_SOURCES: dict[str, ModelSource] = {}


def register_model_source(prefix: str, source: ModelSource) -> None:
    """Make ``<prefix>:<name>`` loadable by ``source(name, device, dtype)``."""
    MODEL_SOURCES[prefix] = source


register_model_source("lsrl", load_builtin)


def resolve_device(device: str | torch.device) -> torch.device:
    """``auto`` picks CUDA when present, else CPU."""
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("device 'cuda' requested but no CUDA device is available")
    return device


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    names = {"auto": None, "float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
             "fp16": torch.float16, "half": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float64": torch.float64, "fp64": torch.float64}
    if dtype not in names:
        raise ModelLoadError(f"unknown dtype {dtype!r}; choose one of {sorted(names)}")
    return names[dtype]


def _finish(model: RecurrentLM, device: torch.device, dtype: torch.dtype | None) -> RecurrentLM:
    model = model.to(device=device, dtype=dtype) if dtype is not None else model.to(device=device)
    return model.eval().requires_grad_(False)


def build_random(preset: str, device: torch.device, dtype: torch.dtype | None, seed: int = 0) -> Loaded:
    """Build a randomly initialised model from a registered preset (deterministic for a given seed)."""
    if preset not in PRESETS:
        raise ModelLoadError(f"unknown preset 'random:{preset}'; known: {', '.join(sorted(PRESETS))}")
    architecture, overrides = PRESETS[preset]
    cls = MODEL_REGISTRY[architecture]
    model = cls(cls.config_class(**overrides))
    model.init_weights(torch.Generator().manual_seed(seed))
    return _finish(model, device, dtype), ByteTokenizer()


def load_checkpoint(path: Path, device: torch.device, dtype: torch.dtype | None) -> Loaded:
    """Load a checkpoint directory (config.json + *.safetensors [+ tokenizer.json])."""
    config_path = path / "config.json"
    if not config_path.exists():
        raise ModelLoadError(f"{path}: no config.json")
    config = json.loads(config_path.read_text())
    architecture = config.get("architecture")
    if architecture not in MODEL_REGISTRY:
        raise ModelLoadError(
            f"{config_path}: unknown architecture {architecture!r}; known: {', '.join(sorted(MODEL_REGISTRY))}"
        )
    cls = MODEL_REGISTRY[architecture]
    try:
        model = cls(cls.config_class.from_dict(config))
    except (TypeError, ValueError) as err:
        raise ModelLoadError(f"{config_path}: {err}") from err
    load_safetensors_into(model, path)
    tokenizer: Tokenizer
    if config.get("alphabet"):  # fixed-alphabet models (compiled LSRL programs)
        tokenizer = CharTokenizer(config["alphabet"])
    elif (path / "tokenizer.json").exists():
        tokenizer = HFTokenizer(path / "tokenizer.json")
    else:
        tokenizer = ByteTokenizer()
    if dtype is None:
        dtype = next(model.parameters()).dtype
    return _finish(model, device, dtype), tokenizer


def load_safetensors_into(model: torch.nn.Module, path: Path) -> None:
    """Read every ``*.safetensors`` file in ``path`` into ``model``; errors name missing/extra/mis-shaped keys."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickles:
            raise ModelLoadError(
                f"{path}: only pickle weights ({', '.join(pickles)}); rnnserve loads safetensors only "
                "(pickle files can execute code) — convert them with safetensors first"
            )
        raise ModelLoadError(f"{path}: no *.safetensors weights")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        weights.update(load_file(str(file)))
    expected = model.state_dict()
    missing = sorted(k for k in expected if k not in weights and not _is_tied_alias(model, k))
    unexpected = sorted(k for k in weights if k not in expected)
    if missing:
        raise ModelLoadError(f"{path}: missing weights {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    if unexpected:
        raise ModelLoadError(f"{path}: unexpected weights {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}")
    for key, tensor in weights.items():
        if tuple(tensor.shape) != tuple(expected[key].shape):
            raise ModelLoadError(
                f"{path}: weight {key} has shape {tuple(tensor.shape)}, config expects {tuple(expected[key].shape)}"
            )
    model.load_state_dict(weights, strict=False)
    float_dtypes = [t.dtype for t in weights.values() if t.is_floating_point()]  # int buffers keep theirs
    model.to(dtype=float_dtypes[0] if float_dtypes else None)


def _is_tied_alias(model: torch.nn.Module, key: str) -> bool:
    """True for a parameter that shares storage with another key (tied embeddings are saved once)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    unique = dict(model.named_parameters())
    return key in params and key not in unique


def save_checkpoint(model: RecurrentLM, path: str | Path, tokenizer_json: str | Path | None = None) -> None:
    """Write ``config.json`` and ``model.safetensors`` (tied weights stored once)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = {"architecture": model.architecture, **model.config.to_dict()}
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tensors = {name: p.detach().contiguous().cpu() for name, p in model.named_parameters()}
    tensors.update({name: b.detach().contiguous().cpu() for name, b in model.named_buffers()})
    save_file(tensors, str(path / "model.safetensors"))
    if tokenizer_json is not None:
        (path / "tokenizer.json").write_bytes(Path(tokenizer_json).read_bytes())


def load_model(name: str, device: str | torch.device = "auto", dtype: str | torch.dtype | None = None) -> Loaded:
    """Resolve ``name`` (``random:<preset>``, ``<prefix>:<name>``, or a directory) to a model and tokenizer."""
    device = resolve_device(device)
    dtype = resolve_dtype(dtype)
    prefix, sep, rest = name.partition(":")
    if sep and prefix == "random":
        return build_random(rest, device, dtype)
    if sep and prefix in MODEL_SOURCES:
        return MODEL_SOURCES[prefix](rest, device, dtype)
    path = Path(name).expanduser()
    if path.is_dir():
        return load_checkpoint(path, device, dtype)
    raise ModelLoadError(f"model {name!r} is not a directory, a random:<preset> or a registered name")


DEFAULT_MODEL_DIR = Path(__file__).parent / "default_model"
"""The embedded byte-level minGRU that ``rnnserve serve`` uses when no ``--model`` is given."""
