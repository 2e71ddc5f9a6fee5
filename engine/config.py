"""One engine configuration, written once: ``LLM(**kwargs)``, ``LLMEngine`` and the CLI flags all come from
:class:`EngineConfig`.

Each field carries its command-line help in ``metadata``; :func:`add_config_arguments` turns a config
dataclass into ``argparse`` flags (``max_num_seqs`` -> ``--max-num-seqs``) and :func:`config_from_args`
reads them back, so a new option is one new field.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

BYTE_UNITS = {
    "": 1, "k": 2**10, "kb": 10**3, "kib": 2**10, "m": 2**20, "mb": 10**6, "mib": 2**20,
    "g": 2**30, "gb": 10**9, "gib": 2**30, "t": 2**40, "tb": 10**12, "tib": 2**40,
}
DEVICES = ["auto", "cpu", "cuda"]
DTYPES = ["auto", "float32", "float16", "bfloat16", "float64"]
QUANTIZATIONS = ["int8", "int4"]
DEFAULT_MAX_MODEL_LEN = 131072  # for models without a length limit of their own


def parse_bytes(text: str) -> int:
    """``"1073741824"``, ``"512M"``, ``"1GiB"``, ``"2GB"`` -> bytes (K/M/G alone are binary units)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in BYTE_UNITS:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (e.g. 1073741824, 512M, 1GiB)")
    return int(float(match.group(1)) * BYTE_UNITS[match.group(2).lower()])


def positive_int(text: str) -> int:
    """An argparse type: an integer of 1 or more."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def non_negative_int(text: str) -> int:
    """An argparse type: an integer of 0 or more."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or a positive integer, got {text}")
    return value


def option(default: Any, help: str, **cli: Any) -> Any:
    """A config field with its CLI help; ``cli`` holds extra argparse keywords (``type``, ``choices``,
    ``metavar``, ``cli_default`` when the command line's default differs, ``flag`` to rename the flag)."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": help, **cli})
    return field(default=default, metadata={"help": help, **cli})


@dataclass
class EngineConfig:
    """What an engine is built from: the model, where it runs, and the limits of its state pool and scheduler."""

    model: str | None = option(
        None, "checkpoint directory, Hugging Face repo id in the local cache, random:<preset> or a registered "
        "name such as lsrl:<program> (default: the embedded model)", metavar="PATH|NAME",
    )
    device: str = option("auto", "where the model and state pool live; auto picks CUDA when present", choices=DEVICES)
    dtype: str | None = option(
        None, "weight dtype; auto keeps the checkpoint's (states always accumulate in fp32+)", choices=DTYPES
    )
    max_num_seqs: int | None = option(64, "state slots, i.e. sequences running at once")
    state_memory: int | None = option(
        None, "state-pool budget, e.g. 2GiB (its scratch slot included); the pool gets the smaller of this and "
        "--max-num-seqs",
        type=parse_bytes, metavar="BYTES",
    )
    max_num_batched_tokens: int = option(
        2048, "prompt tokens prefilled per engine step; longer prompts are chunked"
    )
    max_num_partial_prefills: int = option(
        2, "prompts that may advance in one engine step without finishing (prompts that finish don't count)"
    )
    long_prefill_token_threshold: int = option(
        256, "while requests decode, a prompt gets at most this many tokens per step; a prompt with more left is "
        "long and waits for its share of time (--prefill-time-share)", metavar="TOKENS",
    )
    prefill_time_share: float = option(
        0.3, "while requests decode, the share of engine time prefill may take before long prompts wait (a "
        "prompt within --long-prefill-token-threshold is prefilled at once); 1: no limit",
        type=float, metavar="FRACTION",
    )
    decoded_prompt_tokens: int | None = option(
        None, "while samples decode, a prompt with at most this many tokens left joins the decode step, one "
        "token a step, instead of a prefill call: on a GPU a prefill call costs tens of ms of kernel launches "
        "for a 48-layer model whatever its size, a decode step one CUDA-graph replay for every running sample "
        "(default: 32 where decode replays CUDA graphs, else 0: CPUs prefill short prompts cheaply)",
        type=non_negative_int, metavar="TOKENS",
    )
    max_model_len: int | None = option(
        None, "most tokens per sequence, prompt + max_tokens; beyond it a request gets 400 (default: the "
        f"model's limit, else {DEFAULT_MAX_MODEL_LEN})", metavar="TOKENS",
    )
    max_prompt_tokens: int | None = option(
        None, "most prompt tokens, at most --max-model-len; beyond it a request gets 400 (default: --max-model-len)",
        metavar="TOKENS",
    )
    max_stop_sequences: int = option(16, "most stop strings per request; beyond it a request gets 400", metavar="N")
    max_stop_length: int = option(
        512, "most characters per stop string; beyond it a request gets 400", metavar="CHARS"
    )
    max_waiting: int | None = option(
        None, "requests that may wait for a slot; beyond it the server answers 429", cli_default=256
    )
    max_logprob_entries: int | None = option(
        None, "most logprob entries one request's answer carries (its prompts and samples together; each token's "
        "logprob and its top alternatives, prompt_logprobs and echo included); beyond it a request gets 400",
        cli_default=4_000_000, metavar="N",
    )
    enforce_eager: bool = option(
        False, "on CUDA, run decode eagerly instead of replaying CUDA graphs captured at start-up"
    )
    async_scheduling: str = option(
        "auto", "queue each engine step on the device before reading the previous step's tokens, so the host's "
        "work (outputs, detokenizing, scheduling) overlaps the device's; auto: on for CUDA, where the model runs "
        "asynchronously (on a CPU the model step is the host's own work)", choices=["auto", "on", "off"],
    )
    enable_prefix_cache: bool = option(
        True, "do not keep request states in the prefix cache (a request whose prompt starts with a cached "
        "prompt or prompt + response resumes from its state and prefills only the rest)", flag="--no-prefix-cache",
    )
    prefix_cache_memory: int = option(
        2**30, "prefix-cache snapshot budget on the model's device, e.g. 512MiB (default: 1GiB)",
        type=parse_bytes, metavar="BYTES",
    )
    prefix_cache_host_memory: int = option(
        2 * 2**30, "on CUDA, a second prefix-cache tier in pinned host memory that device evictions move to, "
        "e.g. 8GiB; 0: none (default: 2GiB)", type=parse_bytes, metavar="BYTES",
    )
    prefix_cache_interval: int = option(
        2048, "besides prompt and response ends, snapshot a prompt's state every this many tokens (a prompt chunk "
        "that would cross a multiple ends at it)", metavar="TOKENS",
    )
    quantize: str | None = option(
        None, "weight-only quantization of the linear layers: int8 (per-output-channel symmetric scales) or int4 "
        "(groups of 32 inputs with an fp16 scale, as llama.cpp's Q4_0); fp32 accumulation, states are not "
        "quantized", choices=QUANTIZATIONS,
    )

    def __post_init__(self) -> None:
        if self.dtype == "auto":
            self.dtype = None
        self._check_types()
        positive = (
            "max_num_seqs", "max_num_batched_tokens", "max_num_partial_prefills", "long_prefill_token_threshold",
            "max_model_len", "max_prompt_tokens", "max_waiting", "max_stop_sequences", "max_stop_length",
            "prefix_cache_interval", "max_logprob_entries",
        )
        for name in positive:
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        for name in ("prefix_cache_memory", "prefix_cache_host_memory"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.decoded_prompt_tokens is not None and self.decoded_prompt_tokens < 0:
            raise ValueError(f"decoded_prompt_tokens must be >= 0, got {self.decoded_prompt_tokens}")
        if not 0.0 < self.prefill_time_share <= 1.0:
            raise ValueError(f"prefill_time_share must be in (0, 1], got {self.prefill_time_share}")
        if None not in (self.max_model_len, self.max_prompt_tokens) and self.max_prompt_tokens > self.max_model_len:
            raise ValueError(
                f"max_prompt_tokens ({self.max_prompt_tokens}) exceeds max_model_len ({self.max_model_len})"
            )

    def _check_types(self) -> None:
        """The types the command line's parsing gives, for values passed as keywords (``LLM(max_num_seqs="8")``
        failed deep inside, ``async_scheduling="yes"`` was taken as off): byte sizes may be strings (``"1GiB"``),
        an ``int`` is a ``float``, a choice must be one of the choices (a device also ``cuda:N`` or a
        ``torch.device``, a dtype also a ``torch.dtype``)."""
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            value, expected = getattr(self, f.name), _value_type(hints[f.name])
            if isinstance(value, os.PathLike) and f.name == "model":
                value = os.fspath(value)
            elif isinstance(value, str) and f.metadata.get("type") is parse_bytes:
                value = parse_bytes(value)
            elif expected is float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            setattr(self, f.name, value)
            if value is None and hints[f.name] != expected:
                continue
            if f.name in ("device", "dtype") and not isinstance(value, str):
                continue  # torch.device / torch.dtype, resolved by the loader
            if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
                raise ValueError(f"{f.name} must be {expected.__name__}, got {value!r}")
            choices = f.metadata.get("choices")
            if choices and value not in choices and not (f.name == "device" and re.fullmatch(r"cuda:\d+", value)):
                raise ValueError(f"{f.name} must be one of {', '.join(choices)}, got {value!r}")


ConfigT = TypeVar("ConfigT")


def _value_type(annotation: Any) -> type:
    """``int | None`` -> ``int``."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return args[0]
    return typing.get_origin(annotation) or annotation


def add_config_arguments(parser: argparse.ArgumentParser, cls: type, skip: tuple[str, ...] = ()) -> None:
    """One ``--flag`` per field of the config dataclass ``cls`` that has help metadata."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if "help" not in f.metadata or f.name in skip:
            continue
        meta = dict(f.metadata)
        flag = meta.pop("flag", "--" + f.name.replace("_", "-"))
        kind = _value_type(hints[f.name])
        default = meta.pop("cli_default", f.default if f.default is not dataclasses.MISSING else f.default_factory())
        if kind is bool:  # a flag that flips the default: --enforce-eager, or --no-X for a field on by default
            if default and "flag" not in f.metadata:
                raise ValueError(f"{cls.__name__}.{f.name}: a field that defaults to True needs a --no-... flag")
            action = "store_false" if default else "store_true"
            parser.add_argument(flag, dest=f.name, action=action, help=meta.pop("help"))
            continue
        kwargs: dict[str, Any] = {"dest": f.name, "default": default}
        if kind is list:
            kwargs["nargs"] = "+"
        else:
            kwargs["type"] = positive_int if kind is int else kind
        kwargs.update(meta)
        if default not in (None, []) and "(default" not in kwargs["help"]:
            kwargs["help"] += f" (default: {default})"
        parser.add_argument(flag, **kwargs)


def config_from_args(cls: Callable[..., ConfigT], args: argparse.Namespace, **extra: Any) -> ConfigT:
    """Build ``cls`` from the parsed flags that :func:`add_config_arguments` added (plus ``extra``)."""
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    values = {k: v for k, v in vars(args).items() if k in names}
    return cls(**values, **extra)
