"""The small interface every architecture implements.

A model is a ``torch.nn.Module`` that owns its weights but not its recurrent state. The state lives in
a :class:`~rnnserve.engine.state_pool.StatePool`: one preallocated tensor ``[num_slots, *shape]`` per
:class:`StateSpec`. ``prefill`` and ``decode`` receive that mapping plus a batch (:class:`PrefillBatch`,
:class:`DecodeBatch`) naming the tokens, their positions and the slots of its sequences; they read each
sequence's state from its slot and write the new state back in place.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from rnnserve.engine.sampling_params import InvalidParameterError
from rnnserve.kernels.backend import int64_table, with_host_bounds

StateTensors = Mapping[str, torch.Tensor]


@dataclass(frozen=True)
class StateSpec:
    """One per-slot state tensor: its name, shape (without the slot dimension), dtype and initial value.

    ``initial`` is either a scalar fill value or a tensor of ``shape`` (e.g. orthonormal columns, a
    compiled program's ``s0``); every new request starts from it.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    initial: float | torch.Tensor = 0.0

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


BOOLEAN_WORDS = {"true": True, "false": False}


def config_bool(value: object, name: str) -> bool:
    """A config value that must be a boolean: JSON's ``true``/``false``, or the strings ``"true"``/``"false"`` in any
    case, as some training scripts write them (``"False"`` is not true, as Python's truthiness would have it);
    ValueError naming ``name`` for anything else (``"no"``, ``0``, ``null``)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in BOOLEAN_WORDS:
        return BOOLEAN_WORDS[value.lower()]
    raise ValueError(f"{name} must be true or false, got {value!r}")


@dataclass
class ModelConfig:
    """Base class for architecture configs: a flat dataclass that round-trips through ``config.json``."""

    vocab_size: int = 320

    def __post_init__(self) -> None:
        """Boolean fields read with :func:`config_bool`, however the config was built (``config.json``, a Hugging
        Face config's mapping, a converter)."""
        hints = typing.get_type_hints(type(self))
        for field in dataclasses.fields(self):
            if hints.get(field.name) is bool:
                setattr(self, field.name, config_bool(getattr(self, field.name), field.name))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def check_types(self) -> None:
        """ValueError for a field whose value is not of its declared type, for the plain ones (int, float, bool,
        str, or None where allowed): a config.json writing ``"1e-5"`` for a float loaded and then failed every
        request."""
        hints = typing.get_type_hints(type(self))
        for field in dataclasses.fields(self):
            value, declared = getattr(self, field.name), hints.get(field.name)
            allowed = typing.get_args(declared) if isinstance(declared, types.UnionType) else (declared,)
            if value is None and type(None) in allowed:
                continue
            plain = [t for t in allowed if t in (int, float, bool, str)]
            if len(plain) != len([t for t in allowed if t is not type(None)]):
                continue  # containers, literals and the like: the architecture checks them
            if not any(_of_plain_type(value, t) for t in plain):
                names = " or ".join(t.__name__ for t in allowed)
                raise ValueError(f"{field.name} must be {names}, got {value!r}")

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> ModelConfig:
        """The config of a ``config.json``'s values; raises ``ValueError`` on keys this config does not have."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known - {"architecture", "tokenizer"})
        if unknown:
            raise ValueError(f"{cls.__name__}: unknown config keys {unknown}")
        return cls(**{k: v for k, v in values.items() if k in known})


def _of_plain_type(value: object, declared: type) -> bool:
    """``value`` is a ``declared`` (int, float, bool or str) as JSON gives it: an int is a float too, a bool is
    neither."""
    if isinstance(value, bool) or declared is bool:
        return isinstance(value, bool) and declared is bool
    return isinstance(value, int | float) if declared is float else isinstance(value, declared)


def long_tensor(values: Sequence[int], device: torch.device | str) -> torch.Tensor:
    """Host ints -> an int64 tensor on ``device``, copied without waiting for the device."""
    return int64_table(list(values), device)


@dataclass(frozen=True)
class PrefillBatch:
    """Prompt chunks of ``B`` sequences packed into one variable-length batch (tensors on the model's device).

    ``input_ids [T]`` is every chunk's tokens concatenated, ``cu_seqlens [B + 1]`` the int64 offsets,
    ``slot_ids [B]`` the state slots and ``positions [T]`` each token's index in its whole sequence: a chunk
    that continues a prompt starts at the number of tokens its slot has already consumed. ``starts`` and
    ``lengths`` are the same facts on the host (per sequence), so a model never syncs to read them.
    ``logit_rows [R]`` are the packed rows whose logits ``prefill`` returns, in order: each sequence's last
    token, or every token of the sequences built with ``all_logits`` (for prompt logprobs).
    """

    input_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    slot_ids: torch.Tensor
    positions: torch.Tensor
    starts: tuple[int, ...]
    lengths: tuple[int, ...]
    logit_rows: torch.Tensor

    @classmethod
    def build(
        cls,
        chunks: Sequence[Sequence[int] | torch.Tensor],
        slots: Sequence[int],
        starts: Sequence[int] | None = None,
        device: torch.device | str = "cpu",
        all_logits: Sequence[bool] | None = None,
    ) -> PrefillBatch:
        """Pack token chunks for ``slots``; ``starts`` (default 0) are the tokens each slot consumed before.

        ``all_logits[i]`` asks for the logits of every token of chunk ``i`` instead of only its last."""
        starts = tuple(int(s) for s in starts) if starts is not None else (0,) * len(chunks)
        token_lists = [c.tolist() if isinstance(c, torch.Tensor) else list(c) for c in chunks]
        lengths = tuple(len(c) for c in token_lists)
        flags = tuple(all_logits) if all_logits is not None else (False,) * len(chunks)
        offsets = [0]
        positions: list[int] = []
        logit_rows: list[int] = []
        for start, length, every in zip(starts, lengths, flags, strict=True):
            logit_rows.extend(range(offsets[-1], offsets[-1] + length) if every else (offsets[-1] + length - 1,))
            offsets.append(offsets[-1] + length)
            positions.extend(range(start, start + length))
        return cls(
            input_ids=long_tensor([t for c in token_lists for t in c], device),
            cu_seqlens=with_host_bounds(long_tensor(offsets, device), offsets),
            slot_ids=long_tensor(slots, device),
            positions=long_tensor(positions, device),
            starts=starts,
            lengths=lengths,
            logit_rows=long_tensor(logit_rows, device),
        )


@dataclass(frozen=True)
class DecodeBatch:
    """One token for each of ``B`` sequences: ``input_ids [B]``, ``slot_ids [B]`` and ``positions [B]`` (the
    input token's index in its sequence), int64 on the model's device. Under CUDA graphs these are views of
    static buffers; padded rows use the pool's scratch slot."""

    input_ids: torch.Tensor
    slot_ids: torch.Tensor
    positions: torch.Tensor

    @classmethod
    def build(
        cls,
        token_ids: Sequence[int],
        slots: Sequence[int],
        positions: Sequence[int],
        device: torch.device | str = "cpu",
    ) -> DecodeBatch:
        """A batch from host lists, as int64 tensors on ``device``."""
        return cls(long_tensor(token_ids, device), long_tensor(slots, device), long_tensor(positions, device))


class RecurrentLM(nn.Module):
    """A recurrent language model served by rnnserve.

    Subclasses set ``architecture`` and ``config_class`` and implement ``state_spec``, ``prefill`` and
    ``decode``. ``prefill`` continues each sequence of a :class:`PrefillBatch` from the state in its slot (so
    a prompt may arrive in chunks), writes the final state back and returns the logits of each sequence's
    last token, ``[B, V]`` in fp32 (fp64 for LSRL's fp64 models). ``decode`` advances the ``B`` sequences of a
    :class:`DecodeBatch` by one token each and returns ``[B, V]`` logits.

    A model whose sequences have a length limit sets ``max_model_len``; :meth:`check_request` turns a request
    it cannot serve into a 400 before admission. Architectures that read Hugging Face checkpoints list their
    ``model_type`` values in ``hf_model_types`` and override :meth:`from_hf_config` (and
    :meth:`hf_weight_name` when parameter names differ).
    """

    architecture: ClassVar[str]
    config_class: ClassVar[type[ModelConfig]]
    hf_model_types: ClassVar[tuple[str, ...]] = ()
    non_finite_weights: ClassVar[frozenset[str]] = frozenset()
    """Weights whose NaN or infinite numbers mean something (the model checks them itself); loading refuses
    non-finite numbers in the others."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config

    def state_spec(self) -> list[StateSpec]:
        """The state one sequence carries: one :class:`StateSpec` per tensor (the pool allocates each per slot)."""
        raise NotImplementedError

    def prefill(self, batch: PrefillBatch, state: StateTensors) -> torch.Tensor:
        """Continue each sequence of ``batch`` from its slot's state, write the final state back, and return its
        last token's logits ``[B, V]``."""
        raise NotImplementedError

    def decode(self, batch: DecodeBatch, state: StateTensors) -> torch.Tensor:
        """Advance each sequence of ``batch`` by one token, in place in its slot's state; returns ``[B, V]`` logits."""
        raise NotImplementedError

    @property
    def max_model_len(self) -> int | None:
        """Most tokens (prompt + generated) one sequence may hold; ``None`` for no limit."""
        return None

    def check_request(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Raise :class:`~rnnserve.engine.sampling_params.InvalidParameterError` for a request this model
        cannot serve (called before admission, so it becomes a 400 and never fails a running batch)."""
        limit = self.max_model_len
        if limit is None:
            return
        if num_prompt_tokens > limit:
            raise InvalidParameterError(
                "prompt", f"prompt has {num_prompt_tokens} tokens, the model holds at most {limit}"
            )
        if num_prompt_tokens + max_tokens > limit:
            raise InvalidParameterError(
                "max_tokens",
                f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) exceeds the model's "
                f"{limit}-token limit",
            )

    @classmethod
    def from_hf_config(cls, hf: Mapping[str, Any]) -> ModelConfig:
        """Map a Hugging Face ``config.json`` (one of ``hf_model_types``) to this architecture's config."""
        raise NotImplementedError(f"{cls.__name__} does not read Hugging Face checkpoints")

    @staticmethod
    def hf_weight_name(name: str) -> str:
        """Hugging Face checkpoint key -> parameter name (identity unless the layouts differ)."""
        return name

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """Random initialisation used by ``random:`` presets (overridable per architecture)."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=module.in_features**-0.5, generator=generator)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, std=1.0, generator=generator)


MODEL_REGISTRY: dict[str, type[RecurrentLM]] = {}
PRESETS: dict[str, tuple[str, dict[str, Any]]] = {}


def register_model(cls: type[RecurrentLM]) -> type[RecurrentLM]:
    """Class decorator: make an architecture loadable by its ``architecture`` name."""
    if cls.architecture in MODEL_REGISTRY:
        raise ValueError(f"architecture {cls.architecture!r} registered twice")
    MODEL_REGISTRY[cls.architecture] = cls
    return cls


def register_preset(name: str, architecture: str, **config: Any) -> None:
    """Register a ``random:<name>`` preset: an architecture plus config overrides."""
    if name in PRESETS:
        raise ValueError(f"preset {name!r} registered twice")
    PRESETS[name] = (architecture, config)
