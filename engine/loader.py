"""Model loading: ``<prefix>:<name>`` model sources (``random:``, ``lsrl:``, see
:mod:`rnnserve.engine.model_sources`), checkpoint directories and Hugging Face repo ids found in the local HF
cache.

A checkpoint directory holds ``config.json`` (with ``architecture``), one or more ``*.safetensors`` files
and, unless the model is byte-level or its config says ``"tokenizer": "token_ids"`` (prompts are token ids;
see :class:`~rnnserve.engine.tokenizer.TokenIdTokenizer`), ``tokenizer.json``. A Hugging Face checkpoint
instead has ``model_type`` in its config.json; the architecture whose ``hf_model_types`` lists it maps the
config and weight names.
Weights are read with safetensors only: pickle files (``*.bin``, ``*.pt``, ...) are never opened.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from rnnserve.engine.hf_cache import HFCacheMiss, looks_like_repo_id, resolve_repo_id
from rnnserve.engine.model_sources import Loaded, ModelLoadError, model_source
from rnnserve.engine.models import MODEL_REGISTRY, PRESETS, RecurrentLM
from rnnserve.engine.models.base import ModelConfig
from rnnserve.engine.tokenizer import ByteTokenizer, CharTokenizer, HFTokenizer, TokenIdTokenizer, Tokenizer

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
LOADABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)  # of floating weights
FINITE_CHECK_MAX_ELEMENTS = 1 << 16
"""Loading checks the floating weights of at most this many elements for NaN and infinities: norms, biases, SSM
parameters, the ones a diverged training run poisons with the rest, at well under 1% of a load's time. Checking every
weight would cost 1.5-5x the load itself (docs/models.md); ``rnnserve convert`` checks them all."""


DEFAULT_MODEL_DIR = Path(__file__).parent / "default_model"
"""The embedded byte-level minGRU served when no model is named."""


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


def read_json_object(path: Path) -> dict[str, Any]:
    """A JSON file holding an object; :class:`ModelLoadError` naming the file for anything else."""
    if not path.is_file():  # a directory, or a FIFO that would block the read
        raise ModelLoadError(f"{path}: not a regular file")
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ModelLoadError(f"{path}: cannot read it as JSON: {err}") from err
    if not isinstance(value, dict):
        raise ModelLoadError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def load_checkpoint(path: Path, device: torch.device, dtype: torch.dtype | None) -> Loaded:
    """Load a checkpoint directory (config.json + *.safetensors [+ tokenizer.json])."""
    config_path = path / "config.json"
    if not config_path.exists():
        raise ModelLoadError(f"{path}: no config.json")
    config = read_json_object(config_path)
    if "architecture" not in config and "model_type" in config:
        return load_hf_checkpoint(path, config, device, dtype)
    architecture = config.get("architecture")
    if not isinstance(architecture, str) or architecture not in MODEL_REGISTRY:
        raise ModelLoadError(
            f"{config_path}: unknown architecture {architecture!r}; "
            f"known: {', '.join(sorted(MODEL_REGISTRY))}"
        )
    cls = MODEL_REGISTRY[architecture]
    model_config = _parse_config(config_path, lambda: cls.config_class.from_dict(config))
    model = load_safetensors_into(
        lambda: cls(model_config), path, config_path=config_path, dtype=dtype, non_finite=cls.non_finite_weights
    )
    tokenizer: Tokenizer
    if config.get("alphabet"):  # fixed-alphabet models (compiled LSRL programs)
        tokenizer = CharTokenizer(config["alphabet"])
    elif (path / "tokenizer.json").exists():
        tokenizer = read_hf_tokenizer(path / "tokenizer.json")
    elif config.get("tokenizer") == "token_ids":  # converted without a tokenizer: prompts are token ids
        tokenizer = TokenIdTokenizer(model.vocab_size)
    else:
        tokenizer = ByteTokenizer()
    for spec in model.state_spec():  # a state derived from the weights (Lattice's S0, normalised column by column)
        if isinstance(spec.initial, torch.Tensor) and not bool(torch.isfinite(spec.initial).all()):
            index = tuple(torch.nonzero(~torch.isfinite(spec.initial))[0].tolist())
            raise ModelLoadError(f"{path}: the initial state {spec.name} is not finite at {index} (a zero column?)")
    if dtype is None:
        dtype = next(model.parameters()).dtype
    return _finish(model, device, dtype), tokenizer


def read_hf_tokenizer(file: Path) -> HFTokenizer:
    """The tokenizer in ``file`` (a ``tokenizer.json``, with the ``tokenizer_config.json`` beside it if there is
    one); :class:`ModelLoadError` naming the file that cannot be read."""
    config = file.with_name("tokenizer_config.json")
    if config.exists():
        read_json_object(config)
    if not file.is_file():  # a FIFO would block the open for ever
        raise ModelLoadError(f"{file}: not a regular file")
    try:
        return HFTokenizer(file)
    except Exception as err:  # tokenizers raises a bare Exception for a file it cannot parse
        message = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ModelLoadError(f"{file}: not a tokenizer.json: {message}") from err


def _parse_config(config_path: Path, parse: Callable[[], ModelConfig]) -> ModelConfig:
    """The architecture's config from config.json, its plain fields checked against their types."""
    try:
        model_config = parse()
        model_config.check_types()
    except (KeyError, TypeError, ValueError, AttributeError, ZeroDivisionError) as err:
        raise ModelLoadError(f"{config_path}: {type(err).__name__}: {err}") from err
    return model_config


def hf_architecture(model_type: str) -> type[RecurrentLM]:
    """The registered architecture that reads Hugging Face checkpoints of ``model_type``."""
    for cls in MODEL_REGISTRY.values():
        if model_type in cls.hf_model_types:
            return cls
    known = sorted(t for cls in MODEL_REGISTRY.values() for t in cls.hf_model_types)
    raise ModelLoadError(f"unsupported Hugging Face model_type {model_type!r}; supported: {', '.join(known)}")


def hf_eos_token_ids(path: Path, config: dict[str, Any]) -> list[int]:
    """The ids ``transformers``' ``generate`` stops at: generation_config.json's eos, else config.json's (an id or
    a list of them: instruction-tuned models often end a turn with a second one)."""
    generation_path = path / "generation_config.json"
    generation = read_json_object(generation_path) if generation_path.exists() else {}
    eos = generation.get("eos_token_id", config.get("eos_token_id"))
    ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ModelLoadError(f"{path}: eos_token_id must be a token id or a list of them, got {eos!r}")
    return ids


def load_hf_checkpoint(path: Path, config: dict[str, Any], device: torch.device, dtype: torch.dtype | None) -> Loaded:
    """Load a Hugging Face checkpoint (config.json with ``model_type``, safetensors, tokenizer.json)."""
    cls = hf_architecture(str(config["model_type"]))
    model_config = _parse_config(path / "config.json", lambda: cls.from_hf_config(config))
    model = load_safetensors_into(
        lambda: cls(model_config), path, cls.hf_weight_name, path / "config.json", dtype, cls.non_finite_weights
    )
    if not (path / "tokenizer.json").exists():
        raise ModelLoadError(f"{path}: no tokenizer.json (rnnserve reads HF tokenizers from tokenizer.json)")
    tokenizer = read_hf_tokenizer(path / "tokenizer.json")
    eos_ids = hf_eos_token_ids(path, config)
    if tokenizer.eos_token_id is None:  # else the tokenizer's EOS stops a sample too, as in vLLM
        tokenizer.eos_token_id = eos_ids[0] if eos_ids else None
    tokenizer.extra_eos_token_ids = tuple(i for i in dict.fromkeys(eos_ids) if i != tokenizer.eos_token_id)
    if dtype is None:
        dtype = next(model.parameters()).dtype
    return _finish(model, device, dtype), tokenizer


def _safetensors_files(path: Path) -> tuple[list[Path], dict[str, str] | None]:
    """The shards named by ``model.safetensors.index.json`` and its map of tensor names to shards, else every
    ``*.safetensors`` file and ``None``. Shard names are files of the directory itself."""
    index = path / "model.safetensors.index.json"
    if not index.exists():
        return sorted(path.glob("*.safetensors")), None
    weight_map = read_json_object(index).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ModelLoadError(f"{index}: weight_map must map tensor names to shard file names")
    names = sorted(set(weight_map.values()))
    outside = [n for n in names if Path(n).is_absolute() or ".." in Path(n).parts or n != Path(n).name]
    if outside:
        raise ModelLoadError(f"{index}: shard {outside[0]!r} is not a file of {path}")
    absent = [n for n in names if not (path / n).is_file()]
    if absent:
        raise ModelLoadError(f"{path}: shard {absent[0]} listed in {index.name} is missing")
    stray = sorted(p.name for p in path.glob("*.safetensors") if p.name not in weight_map.values())
    if stray:  # transformers would load a model.safetensors beside the shards instead: which weights are meant?
        raise ModelLoadError(f"{path}: {stray[0]} is not one of the shards {index.name} lists; remove one or the other")
    return [path / n for n in names], weight_map


def _read_safetensors(
    file: Path, dtype: torch.dtype, non_finite: frozenset[str] = frozenset()
) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of ``file`` one at a time, each a fresh tensor of its own memory: floating ones of a loadable
    dtype in ``dtype``, the rest as stored. Reading one at a time keeps the peak at the model's size: the file is
    mapped, not copied whole. The small floating ones not named in ``non_finite`` are checked for NaN and
    infinities (:data:`FINITE_CHECK_MAX_ELEMENTS`)."""
    try:
        with safe_open(str(file), framework="pt") as tensors:
            for key in tensors.keys():  # noqa: SIM118 - safe_open is not a mapping
                tensor = tensors.get_tensor(key)
                if tensor.dtype not in LOADABLE_DTYPES:
                    yield key, tensor.clone()
                    continue
                loaded = tensor.to(dtype, copy=True)
                if loaded.numel() <= FINITE_CHECK_MAX_ELEMENTS and key not in non_finite:
                    _check_finite_weight(file, key, tensor, loaded)
                yield key, loaded
    except (SafetensorError, OSError) as err:
        raise ModelLoadError(f"{file}: not a readable safetensors file: {err}") from err


def non_finite_summary(tensor: torch.Tensor) -> str | None:
    """How many NaN and infinite numbers a floating ``tensor`` holds and where the first is; ``None`` if none."""
    if not tensor.is_floating_point():
        return None
    bad = ~torch.isfinite(tensor)
    if not bool(bad.any()):
        return None
    nans = int(torch.isnan(tensor).sum())
    first = tuple(torch.nonzero(bad)[0].tolist())
    return f"{nans} NaN and {int(bad.sum()) - nans} infinite numbers (the first at {first})"


def _check_finite_weight(file: Path, key: str, stored: torch.Tensor, loaded: torch.Tensor) -> None:
    """:class:`ModelLoadError` naming a weight that holds NaN or infinite numbers as loaded: stored so, or finite
    numbers beyond the range of the dtype asked for (fp16's 65504)."""
    found = non_finite_summary(loaded)
    if found is None:
        return
    if non_finite_summary(stored) is None:
        raise ModelLoadError(
            f"{file}: weight {key} holds numbers up to {float(stored.abs().max()):.4g}, beyond the range of "
            f"{str(loaded.dtype).removeprefix('torch.')}: load it in a wider dtype (--dtype bfloat16 or float32)"
        )
    raise ModelLoadError(f"{file}: weight {key} holds {found}; a model with it would compute NaN")


def _stored_dtype(files: list[Path]) -> torch.dtype:
    """The dtype a checkpoint's weights load in when none is asked for: that of most of its floating weights'
    elements (a mostly fp32 checkpoint with a bf16 embedding stays fp32), read from the headers alone; fp32 for
    one without floating weights."""
    by_name = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}
    elements: dict[torch.dtype, int] = dict.fromkeys(LOADABLE_DTYPES, 0)
    for file in files:
        if file.exists() and not file.is_file():  # a directory, or a FIFO that would block the read
            raise ModelLoadError(f"{file}: not a regular file")
        try:
            with safe_open(str(file), framework="pt") as tensors:
                for key in tensors.keys():  # noqa: SIM118 - safe_open is not a mapping
                    piece = tensors.get_slice(key)
                    dtype = by_name.get(piece.get_dtype())
                    if dtype is not None:
                        elements[dtype] += math.prod(piece.get_shape())
        except (SafetensorError, OSError) as err:
            raise ModelLoadError(f"{file}: not a readable safetensors file: {err}") from err
    return max(elements, key=lambda d: (elements[d], d.itemsize)) if any(elements.values()) else torch.float32


def load_safetensors_into(
    build: Callable[[], RecurrentLM],
    path: Path,
    rename: Callable[[str], str] | None = None,
    config_path: Path | None = None,
    dtype: torch.dtype | None = None,
    non_finite: frozenset[str] = frozenset(),
) -> RecurrentLM:
    """The model ``build`` makes, with the ``*.safetensors`` weights in ``path``, its floating weights in
    ``dtype`` (``None``: the checkpoint's, that of most of its weights where they differ).

    Errors name missing, unexpected, mis-shaped, duplicated and mistyped keys. The weights are checked against
    the model built on the meta device first, so a config whose sizes disagree with them (a vocabulary of
    millions) fails before the model's memory is allocated.

    ``rename`` maps checkpoint keys to parameter names. A tied parameter may be stored under either name.
    ``non_finite`` names checkpoint keys that may hold NaN or infinities (the model checks them itself).

    Each tensor is read and converted on its own and becomes the parameter itself: the peak is about the
    loaded model's size, not the checkpoint's plus a randomly initialised fp32 copy of the model.
    """
    files, weight_map = _safetensors_files(path)
    if not files:
        pickles = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickles:
            raise ModelLoadError(
                f"{path}: only pickle weights ({', '.join(pickles)}); rnnserve loads safetensors only "
                "(pickle files can execute code); `rnnserve convert` reads the formats it knows without running "
                "pickled code, or save the tensors with safetensors"
            )
        raise ModelLoadError(f"{path}: no *.safetensors weights")
    dtype = dtype or _stored_dtype(files)
    weights: dict[str, torch.Tensor] = {}
    source: dict[str, str] = {}  # parameter name -> the checkpoint key and file it came from
    for file in files:
        for key, tensor in _read_safetensors(file, dtype, non_finite):
            if weight_map is not None and key not in weight_map:  # transformers would drop it: which is meant?
                raise ModelLoadError(f"{file}: holds {key}, which model.safetensors.index.json does not list")
            if weight_map is not None and weight_map[key] != file.name:
                raise ModelLoadError(f"{file}: holds {key}, which the shard index puts in {weight_map[key]}")
            name = rename(key) if rename else key
            if name in weights:
                raise ModelLoadError(f"{path}: weight {name} is stored twice ({source[name]} and {key} in {file.name})")
            weights[name] = tensor
            source[name] = f"{key} in {file.name}"
    layout = _layout(build, config_path or path)
    _check_weights(layout, weights, path)
    if next(layout.parameters()).is_meta:
        model = _assign_weights(layout, weights)
        if model is not None:
            return model
        layout = _build(build, config_path or path)
    layout.load_state_dict(weights, strict=False)
    return layout.to(dtype=dtype)


def _assign_weights(layout: RecurrentLM, weights: dict[str, torch.Tensor]) -> RecurrentLM | None:
    """The meta-device ``layout`` made real by taking the checked ``weights`` as its parameters and buffers
    (no copy, no random initialisation), with tied parameters tied again; ``None`` when the model keeps a
    tensor of its own that no weight replaces (one its constructor derived), which only a real build has."""
    tied = _tied_groups(layout)
    expected = layout.state_dict()
    layout.load_state_dict(  # integer buffers (index tables) keep the model's dtype, whatever the file stored
        {k: t if expected[k].is_floating_point() else t.to(expected[k].dtype) for k, t in weights.items()},
        strict=False,
        assign=True,
    )
    for names in tied:
        shared = layout.get_parameter(next(n for n in names if n in weights))
        for name in names:
            owner, _, attribute = name.rpartition(".")
            setattr(layout.get_submodule(owner), attribute, shared)
    return None if _holds_meta_tensor(layout) else layout


def _tied_groups(model: torch.nn.Module) -> list[list[str]]:
    """The names of each parameter the model registers under more than one name."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def _holds_meta_tensor(model: torch.nn.Module) -> bool:
    """True if a parameter, buffer or tensor attribute (also in a list, tuple or dict) of a module is on the
    meta device."""

    def meta(value: object) -> bool:
        if isinstance(value, torch.Tensor):
            return value.is_meta
        if isinstance(value, list | tuple):
            return any(meta(v) for v in value)
        if isinstance(value, dict):
            return any(meta(v) for v in value.values())
        return False

    return any(meta(value) for module in model.modules() for value in vars(module).values())


def check_native_weights(config: dict[str, Any], weights: dict[str, torch.Tensor], where: Path) -> None:
    """``config.json`` values and tensors of a native checkpoint are a model of its architecture (names, shapes,
    dtypes, ties; checked on the meta device): what ``rnnserve convert`` checks before it writes them."""
    architecture = config.get("architecture")
    if not isinstance(architecture, str) or architecture not in MODEL_REGISTRY:
        raise ModelLoadError(f"{where}: unknown architecture {architecture!r}")
    cls = MODEL_REGISTRY[architecture]
    model_config = _parse_config(where, lambda: cls.config_class.from_dict(config))
    _check_weights(_layout(lambda: cls(model_config), where), weights, where)


def _layout(build: Callable[[], RecurrentLM], config_path: Path) -> RecurrentLM:
    """The model built on the meta device (no memory), or for real where an architecture cannot be."""
    try:
        with torch.device("meta"):
            return build()
    except Exception:  # noqa: BLE001 - a config it cannot take (raised again, named) or a layer that needs memory
        return _build(build, config_path)


def _build(build: Callable[[], RecurrentLM], config_path: Path) -> RecurrentLM:
    try:
        return build()
    except Exception as err:  # sizes the layers cannot take (negative, zero where they divide)
        raise ModelLoadError(f"{config_path}: cannot build the model: {type(err).__name__}: {err}") from err


def _check_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor], path: Path) -> None:
    """The weights' names, shapes and dtypes are the model's, and tied parameters get one tensor."""
    expected = model.state_dict()
    missing = sorted(k for k in expected if k not in weights and not _tied_and_present(model, k, weights))
    unexpected = sorted(k for k in weights if k not in expected)
    if missing:
        raise ModelLoadError(f"{path}: missing weights {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    if unexpected:
        more = " ..." if len(unexpected) > 5 else ""
        raise ModelLoadError(f"{path}: unexpected weights {unexpected[:5]}{more}")
    for key, tensor in weights.items():
        if tuple(tensor.shape) != tuple(expected[key].shape):
            raise ModelLoadError(
                f"{path}: weight {key} has shape {tuple(tensor.shape)}, "
                f"config expects {tuple(expected[key].shape)}"
            )
        if expected[key].is_floating_point() and tensor.dtype not in LOADABLE_DTYPES:
            raise ModelLoadError(
                f"{path}: weight {key} has dtype {str(tensor.dtype).removeprefix('torch.')}; rnnserve loads "
                "float32, bfloat16, float16 and float64 weights"
            )
    _check_tied_copies(model, weights, path)


def _check_tied_copies(model: torch.nn.Module, weights: dict[str, torch.Tensor], path: Path) -> None:
    """A parameter the model shares under two names (an LM head tied to the embedding) must not come from two
    different tensors: the last one loaded would silently replace the other (``tie_word_embeddings`` set, or
    defaulted, for a checkpoint trained untied)."""
    for shared in _tied_groups(model):
        stored = [name for name in shared if name in weights]
        for other in stored[1:]:
            if not torch.equal(weights[stored[0]], weights[other]):
                raise ModelLoadError(
                    f"{path}: {stored[0]} and {other} are one tied weight in this model (tie_word_embeddings), "
                    "but the checkpoint holds two different tensors; set tie_word_embeddings to false in "
                    "config.json if the model was trained untied"
                )


def _tied_and_present(model: torch.nn.Module, key: str, weights: dict[str, torch.Tensor]) -> bool:
    """True for a parameter shared with another name the checkpoint holds (tied weights are saved once)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    if key not in params:
        return False
    return any(other in weights for other, p in params.items() if p is params[key] and other != key)


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


def load_model(
    name: str | None, device: str | torch.device = "auto", dtype: str | torch.dtype | None = None
) -> Loaded:
    """Resolve ``name`` (``<prefix>:<name>`` of a registered model source such as ``random:<preset>``, a
    directory or an HF repo id in the local cache; ``None`` for the embedded default model) to a model and
    tokenizer."""
    device = resolve_device(device)
    dtype = resolve_dtype(dtype)
    name = str(DEFAULT_MODEL_DIR) if name is None else name
    prefix, sep, rest = name.partition(":")
    source = model_source(prefix) if sep else None
    if source is not None:
        return source(rest, device, dtype)
    path = Path(name).expanduser()
    if path.is_dir():
        return load_checkpoint(path, device, dtype)
    if looks_like_repo_id(name):
        try:
            return load_checkpoint(resolve_repo_id(name), device, dtype)
        except HFCacheMiss as err:
            raise ModelLoadError(str(err)) from err
    raise ModelLoadError(f"model {name!r} is not a directory, a random:<preset> or a registered name")

