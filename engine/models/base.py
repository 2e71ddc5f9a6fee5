"""The small interface every architecture implements.

A model is a ``torch.nn.Module`` that owns its weights but not its recurrent state. The state lives in
a :class:`~rnnserve.engine.state_pool.StatePool`: one preallocated tensor ``[num_slots, *shape]`` per
:class:`StateSpec`. ``prefill`` and ``decode`` receive that mapping plus the slot ids of the sequences
in the batch, read each sequence's state from its slot and write the new state back in place.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

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
        return self.numel * torch.empty((), dtype=self.dtype).element_size()


@dataclass
class ModelConfig:
    """Base class for architecture configs: a flat dataclass that round-trips through ``config.json``."""

    vocab_size: int = 320

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> ModelConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known - {"architecture", "tokenizer"})
        if unknown:
            raise ValueError(f"{cls.__name__}: unknown config keys {unknown}")
        return cls(**{k: v for k, v in values.items() if k in known})


class RecurrentLM(nn.Module):
    """A recurrent language model served by rnnserve.

    Subclasses set ``architecture`` and ``config_class`` and implement the three methods below.
    ``prefill`` takes a packed variable-length batch: ``input_ids`` is every sequence's tokens
    concatenated (``[T]``), ``cu_seqlens`` the ``[B + 1]`` int64 offsets, ``slot_ids`` the ``[B]`` slots.
    It continues each sequence from the state in its slot (so a prompt may arrive in chunks), writes the
    final state back and returns the logits of each sequence's last token, ``[B, V]`` in fp32.
    ``decode`` advances ``B`` sequences by one token each and returns ``[B, V]`` fp32 logits.
    """

    architecture: ClassVar[str]
    config_class: ClassVar[type[ModelConfig]]

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config

    def state_spec(self) -> list[StateSpec]:
        raise NotImplementedError

    def prefill(
        self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor, slot_ids: torch.Tensor, state: StateTensors
    ) -> torch.Tensor:
        raise NotImplementedError

    def decode(self, input_ids: torch.Tensor, slot_ids: torch.Tensor, state: StateTensors) -> torch.Tensor:
        raise NotImplementedError

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
