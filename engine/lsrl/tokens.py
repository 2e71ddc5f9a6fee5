"""Token interfaces of compiled LSRL models: how token ids become program inputs and outputs become tokens.

Scalar models (one input dimension) use ``E[v] = v``: token ``v`` feeds the number ``v``. Programs with
several input dimensions use an embedding table, one input vector per token. The head scores token ``v``
by ``-(y - v)^2`` (scaled, see ``rnnserve.engine.models.lsrl``) for the program output ``y``, so decoding
returns the token whose value is nearest to ``y``; tokens without a value (NaN) are never generated.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

DTYPE = torch.float64


@dataclass(frozen=True)
class TokenInterface:
    """Token ``i``: text ``alphabet[i]``, input vector ``embedding[i]``, output value ``values[i]``."""

    alphabet: tuple[str, ...]
    embedding: torch.Tensor
    values: torch.Tensor

    def __post_init__(self) -> None:
        size = len(self.alphabet)
        if not all(isinstance(s, str) for s in self.alphabet):  # ALPHABET = [1, 2, 3] compiled, then failed to load
            raise ValueError("token strings must be strings")
        if len(set(self.alphabet)) != size or any(not s for s in self.alphabet):
            raise ValueError("token strings must be distinct and non-empty")
        if self.embedding.dim() != 2 or self.embedding.shape[0] != size or tuple(self.values.shape) != (size,):
            raise ValueError(
                f"{size} tokens need an embedding [{size}, input_dim] and values [{size}]; got "
                f"{tuple(self.embedding.shape)} and {tuple(self.values.shape)}"
            )
        if not torch.isfinite(self.embedding).all() or torch.isinf(self.values).any():
            raise ValueError("embeddings must be finite and values finite (or None for input-only tokens)")
        if torch.isnan(self.values).all():  # every token input-only: the head would have nothing to generate
            raise ValueError("at least one token needs a value (None marks an input-only token)")

    @property
    def input_dim(self) -> int:
        return self.embedding.shape[1]

    @classmethod
    def scalar(cls, alphabet: Sequence[str]) -> TokenInterface:
        """Token ``v`` (text ``alphabet[v]``) feeds the number ``v``, and is generated for outputs near it."""
        values = torch.arange(len(alphabet), dtype=DTYPE)
        return cls(tuple(alphabet), values.reshape(-1, 1).clone(), values)

    @classmethod
    def table(
        cls, alphabet: Sequence[str], embedding: Sequence[Sequence[float]], values: Sequence[float | None]
    ) -> TokenInterface:
        """An explicit vector embedding per token; ``None`` values mark input-only tokens."""
        vals = torch.tensor([float("nan") if v is None else float(v) for v in values], dtype=DTYPE)
        return cls(tuple(alphabet), torch.as_tensor(embedding, dtype=DTYPE), vals)


def _num(v: float) -> str:
    return f"{v:g}"


def approximator_tokens(d_in: int = 2, delta: float = 0.5, grid: float = 0.1, max_value: int = 9) -> TokenInterface:
    """Text tokens for Listing 1 with ``d_out = 1`` on a fixed cell size ``delta``.

    ``"0"`` .. ``"9"``: outputs (value k); as inputs they are the zero vector, a cell of size 0 that
    changes nothing, so a greedy continuation repeats the answer. ``"(0.7,0.2)"``: a query on a ``grid``
    of ``[0, 1]^d_in``. ``"[0.5,0]=3"``: the cell with lower corner ``(0.5, 0)`` and value 3.
    """
    steps = round(1 / grid)
    cells = round(1 / delta)
    alphabet: list[str] = []
    embedding: list[list[float]] = []
    values: list[float | None] = []
    for k in range(max_value + 1):
        alphabet.append(str(k))
        embedding.append([0.0] * (d_in + 2))
        values.append(k)
    for index in torch.cartesian_prod(*[torch.arange(steps + 1)] * d_in).reshape(-1, d_in).tolist():
        q = [i / steps for i in index]
        alphabet.append("(" + ",".join(_num(v) for v in q) + ")")
        embedding.append([*q, 0.0, 0.0])
        values.append(None)
    for index in torch.cartesian_prod(*[torch.arange(cells)] * d_in).reshape(-1, d_in).tolist():
        lower = [i * delta for i in index]
        for k in range(max_value + 1):
            alphabet.append("[" + ",".join(_num(v) for v in lower) + f"]={k}")
            embedding.append([delta, *lower, float(k)])
            values.append(None)
    return TokenInterface.table(alphabet, embedding, values)
