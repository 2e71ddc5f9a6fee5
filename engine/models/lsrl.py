"""Compiled LSRL programs served as recurrent language models (``architecture: "lsrl"``).

The model is the compiled path: an ordered list of layers (sparse ``linear``, ``relu``, ``multi`` and
``linstate``), see :mod:`rnnserve.engine.lsrl.compiler`. Tokens enter through an embedding table (``E[v] = v`` for
scalar programs) and the scalar program output ``y`` is scored by ``logits_v = -100 (y - v)^2`` (see
:mod:`rnnserve.engine.lsrl.tokens`).

State: for every ``linstate`` layer, only the state dimensions its ``A`` reads at the next token (non-zero
columns) are kept, concatenated into one ``state`` vector per slot and initialised from ``s0``.

Numerics: weights, activations, state and logits are in the model dtype: fp64 by default (exact for the
built-ins), fp32 on request. Folding multiplies step gains, so compiled programs can fail in fp32
(``tests/lsrl/test_fp32.py`` records which built-ins stay exact). Logits are returned in the model dtype so
that the nearest-integer choice is made from fp64 scores; the sampler may cast them to fp32, which is
exact as long as ``y`` is not within about 1e-5 of a half-integer.

Checkpoint: ``config.json`` carries the op list with every op's shapes and non-zero counts; the safetensors
file holds ``embedding``, ``token_values`` (NaN: never generated) and per layer ``bias``, ``init_state``
and sparse matrices as ``<name>.indices`` (int64 ``[2, nnz]``, coalesced order) and ``<name>.values``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from rnnserve.engine.lsrl.compiler import LinOp, LinStateOp, MultiOp, Path, ReLUOp
from rnnserve.engine.lsrl.tokens import TokenInterface
from rnnserve.engine.model_sources import ModelLoadError
from rnnserve.engine.models.base import (
    DecodeBatch,
    ModelConfig,
    PrefillBatch,
    RecurrentLM,
    StateSpec,
    StateTensors,
    register_model,
)
from rnnserve.engine.models.layers import gather_slots, scatter_slots

FLOAT = torch.float64
# The head's scale: one unit of distance between the program's output and a token's value costs 100 in logit, so
# the nearest token is the sample whatever the temperature (the next is e^-100 as likely at y = v).
HEAD_SHARPNESS = 100.0
logger = logging.getLogger(__name__)


# The keys of each op in config.json's ``ops`` (what :meth:`LSRLModel.from_path` writes), all read.
OP_KEYS = {
    "linear": {"type", "in_dim", "out_dim", "nnz"},
    "relu": {"type", "in_dim", "out_dim"},
    "multi": {"type", "in_dim", "out_dim"},
    "linstate": {"type", "in_dim", "out_dim", "dim", "a_nnz", "b_nnz", "persistent"},
}


def op_spec_problem(index: int, spec: Any) -> str | None:
    """Why ``spec`` cannot be op ``index`` of a served program (an unknown type, a key the op does not have, an output
    width its computation does not give), naming it; ``None`` if it can."""
    if not isinstance(spec, dict):
        return f"LSRL op {index} is a {type(spec).__name__}, not a dict"
    kind = spec.get("type")
    if kind not in OP_KEYS:
        return f"unknown LSRL op type {kind!r} (op {index}; known: {sorted(OP_KEYS)})"
    keys = set(spec)
    if keys != OP_KEYS[kind]:
        return (f"LSRL op {index} ({kind}) has keys {sorted(keys - OP_KEYS[kind])} it does not read and lacks "
                f"{sorted(OP_KEYS[kind] - keys)}; a {kind} op has {sorted(OP_KEYS[kind])}")
    width = {"relu": spec["in_dim"], "multi": spec["in_dim"] // 2, "linstate": spec.get("dim")}.get(kind)
    if kind == "multi" and spec["in_dim"] % 2:
        return f"LSRL op {index} (multi) multiplies two halves of its input, whose in_dim {spec['in_dim']} is odd"
    if width is not None and spec["out_dim"] != width:
        return f"LSRL op {index} ({kind}) outputs {width} numbers, but its out_dim is {spec['out_dim']}"
    return None


@dataclass
class LSRLConfig(ModelConfig):
    vocab_size: int = 2
    input_dim: int = 1
    ops: list[dict[str, Any]] = field(default_factory=list)
    alphabet: list[str] | None = None


class SparseMatrix(nn.Module):
    """A fixed-pattern sparse ``[rows, cols]`` matrix: int64 COO ``indices`` and float ``values``."""

    def __init__(self, rows: int, cols: int, nnz: int) -> None:
        super().__init__()
        self.shape = (rows, cols)
        self.register_buffer("indices", torch.zeros(2, nnz, dtype=torch.long))
        self.values = nn.Parameter(torch.zeros(nnz, dtype=FLOAT), requires_grad=False)

    def load(self, matrix: torch.Tensor) -> None:
        matrix = matrix.coalesce()
        self.indices.copy_(matrix.indices())
        self.values.copy_(matrix.values())

    def index_problem(self) -> str | None:
        """Why ``indices`` cannot be this matrix's (out of range, or not in the strictly increasing row-major
        order that :meth:`matrix` declares as coalesced); ``None`` if they can."""
        rows, cols = self.shape
        if self.indices.numel() == 0:
            return None
        low, high = self.indices.amin(dim=1).tolist(), self.indices.amax(dim=1).tolist()
        if low[0] < 0 or low[1] < 0 or high[0] >= rows or high[1] >= cols:
            return f"holds an index outside its [{rows}, {cols}] matrix"
        flat = self.indices[0] * cols + self.indices[1]
        if not bool((flat[1:] > flat[:-1]).all()):
            return "is not in row-major order without repeats"
        return None

    def matrix(self, columns: torch.Tensor | None = None) -> torch.Tensor:
        """The sparse tensor; with ``columns`` (sorted, covering every non-zero column) only those columns."""
        indices, shape = self.indices, self.shape
        if columns is not None:
            indices = torch.stack([indices[0], torch.searchsorted(columns, indices[1])])
            shape = (shape[0], columns.numel())
        return torch.sparse_coo_tensor(indices, self.values, shape, is_coalesced=True, check_invariants=False)

    def apply(self, x: torch.Tensor, columns: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ M.T`` for ``x`` of shape ``[N, cols]``."""
        if self.values.numel() == 0:
            return x.new_zeros(x.shape[0], self.shape[0])
        return torch.sparse.mm(self.matrix(columns), x.t()).t()


class LinearLayer(nn.Module):
    def __init__(self, spec: dict[str, Any]) -> None:
        super().__init__()
        self.weight = SparseMatrix(spec["out_dim"], spec["in_dim"], spec["nnz"])
        self.bias = nn.Parameter(torch.zeros(spec["out_dim"], dtype=FLOAT), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight.apply(x) + self.bias


class ReLULayer(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x)


class MultiLayer(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        half = x.shape[1] // 2
        return x[:, :half] * x[:, half:]


class LinStateLayer(nn.Module):
    """``s_t = A s_{t-1} + B x_t + b``, scanned sequentially (``A`` may be any matrix: rotations, shifts)."""

    def __init__(self, spec: dict[str, Any]) -> None:
        super().__init__()
        dim = spec["dim"]
        self.A = SparseMatrix(dim, dim, spec["a_nnz"])
        self.B = SparseMatrix(dim, spec["in_dim"], spec["b_nnz"])
        self.bias = nn.Parameter(torch.zeros(dim, dtype=FLOAT), requires_grad=False)
        self.init_state = nn.Parameter(torch.zeros(dim, dtype=FLOAT), requires_grad=False)
        self.persistent = list(spec["persistent"])
        if any(not isinstance(i, int) for i in self.persistent) or self.persistent != sorted(set(self.persistent)):
            raise ValueError(f"persistent must be increasing state indices, got {self.persistent}")
        if self.persistent and not 0 <= self.persistent[0] <= self.persistent[-1] < dim:
            raise ValueError(f"persistent {self.persistent} holds an index outside the state's {dim} dimensions")
        self._keep: dict[torch.device, torch.Tensor] = {}

    def _recurrence(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The persistent dimensions (index tensor, cached per device) and ``A`` restricted to them."""
        if device not in self._keep:
            self._keep[device] = torch.tensor(self.persistent, dtype=torch.long, device=device)
        keep = self._keep[device]
        return keep, self.A.matrix(keep)

    def forward(
        self, x: torch.Tensor, cu_seqlens: torch.Tensor | None, state: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` packed ``[T, in]`` (``cu_seqlens=None``: one token per sequence, no host sync);
        ``state`` ``[B, len(persistent)]``. Returns the outputs ``s_t`` and the final states."""
        update = self.B.apply(x) + self.bias
        if not self.persistent:
            return update, state
        keep, a = self._recurrence(x.device)
        if cu_seqlens is None:
            out = update + torch.sparse.mm(a, state.t()).t()
            return out, out[:, keep]
        lengths = cu_seqlens[1:] - cu_seqlens[:-1]
        out = update.clone()
        state = state.clone()
        for t in range(int(lengths.max())):
            active = torch.nonzero(lengths > t).reshape(-1)
            rows = cu_seqlens[:-1][active] + t
            s = update[rows] + torch.sparse.mm(a, state[active].t()).t()
            out[rows] = s
            state[active] = s[:, keep]
        return out, state


@register_model
class LSRLModel(RecurrentLM):
    """A compiled LSRL program with a token interface (see the module docstring)."""

    architecture = "lsrl"
    config_class = LSRLConfig
    non_finite_weights = frozenset({"token_values"})  # NaN: a token that is never generated

    def __init__(self, config: LSRLConfig) -> None:
        super().__init__(config)
        self.embedding = nn.Parameter(
            torch.zeros(config.vocab_size, config.input_dim, dtype=FLOAT), requires_grad=False
        )
        self.token_values = nn.Parameter(torch.zeros(config.vocab_size, dtype=FLOAT), requires_grad=False)
        layers: list[nn.Module] = []
        width = config.input_dim
        for index, spec in enumerate(config.ops):
            problem = op_spec_problem(index, spec)
            if problem is not None:
                raise ValueError(problem)
            kind = spec["type"]
            if kind == "linear":
                layers.append(LinearLayer(spec))
            elif kind == "relu":
                layers.append(ReLULayer())
            elif kind == "multi":
                layers.append(MultiLayer())
            else:
                layers.append(LinStateLayer(spec))
            if spec["in_dim"] != width:
                raise ValueError(f"LSRL op {len(layers) - 1} ({kind}) takes {spec['in_dim']} inputs, gets {width}")
            width = spec["out_dim"]
        if width != 1:
            raise ValueError(f"a served LSRL program must output one number per token, this one outputs {width}")
        alphabet = config.alphabet
        if (
            not isinstance(alphabet, list)
            or len(alphabet) != config.vocab_size
            or any(not isinstance(s, str) or not s for s in alphabet)
            or len(set(alphabet)) != len(alphabet)
        ):
            raise ValueError(f"alphabet must list {config.vocab_size} distinct non-empty token strings")
        self.layers = nn.ModuleList(layers)
        self.register_load_state_dict_post_hook(lambda module, _keys: module.check_weights())

    @classmethod
    def from_path(cls, path: Path, tokens: TokenInterface) -> LSRLModel:
        """Build the model of a compiled program with the given token interface (weights in fp64)."""
        if path.input_dim != tokens.input_dim:
            raise ValueError(f"program input has {path.input_dim} dimensions, token embedding {tokens.input_dim}")
        specs: list[dict[str, Any]] = []
        for op in path.ops:
            spec: dict[str, Any] = {"in_dim": op.in_dim, "out_dim": op.out_dim}
            if isinstance(op, LinOp):
                spec.update(type="linear", nnz=op.weight._nnz())
            elif isinstance(op, ReLUOp):
                spec.update(type="relu")
            elif isinstance(op, MultiOp):
                spec.update(type="multi")
            else:
                spec.update(
                    type="linstate",
                    dim=op.out_dim,
                    a_nnz=op.A._nnz(),
                    b_nnz=op.B._nnz(),
                    persistent=op.persistent.tolist(),
                )
            specs.append(spec)
        config = LSRLConfig(
            vocab_size=len(tokens.alphabet),
            input_dim=path.input_dim,
            ops=specs,
            alphabet=list(tokens.alphabet),
        )
        model = cls(config)
        with torch.no_grad():
            model.embedding.copy_(tokens.embedding)
            model.token_values.copy_(tokens.values)
            for layer, op in zip(model.layers, path.ops, strict=True):
                if isinstance(op, LinOp):
                    layer.weight.load(op.weight)
                    layer.bias.copy_(op.bias)
                elif isinstance(op, LinStateOp):
                    layer.A.load(op.A)
                    layer.B.load(op.B)
                    layer.bias.copy_(op.bias)
                    layer.init_state.copy_(op.init_state)
        return model.eval()

    def check_weights(self) -> None:
        """Raise :class:`ModelLoadError` for loaded weights that would serve wrongly: a sparse index outside its
        matrix or out of order, a ``linstate`` whose ``A`` reads a dimension outside ``persistent``, non-finite
        weights, an infinite token value or no token with a value."""
        tensors = dict(self.state_dict())
        if any(t.is_meta for t in tensors.values()):
            return
        modules = dict(self.named_modules())
        for name, module in modules.items():
            if isinstance(module, SparseMatrix) and (problem := module.index_problem()) is not None:
                raise ModelLoadError(f"LSRL checkpoint: {name}.indices {problem}")
        for name, module in modules.items():
            if isinstance(module, LinStateLayer):
                read = set(torch.unique(module.A.indices[1]).tolist())
                if not read <= set(module.persistent):
                    raise ModelLoadError(
                        f"LSRL checkpoint: {name}.A reads state dimensions {sorted(read - set(module.persistent))} "
                        "that its persistent list does not keep"
                    )
        for name, tensor in tensors.items():
            if name != "token_values" and tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                raise ModelLoadError(f"LSRL checkpoint: {name} holds NaN or infinite numbers")
        values = self.token_values
        if bool(torch.isinf(values).any()) or bool(torch.isnan(values).all()):
            raise ModelLoadError("LSRL checkpoint: token_values must be finite, or NaN for input-only tokens, "
                                 "with at least one token having a value")  # fmt: skip

    @property
    def dtype(self) -> torch.dtype:
        return self.embedding.dtype

    def state_spec(self) -> list[StateSpec]:
        if self.dtype != torch.float64:
            logger.warning(
                "LSRL model in %s: compiled programs can give wrong answers below fp64 (docs/lsrl.md)", self.dtype
            )
        initial = [layer.init_state.detach()[layer.persistent] for layer in self._linstates()]
        init = torch.cat(initial) if initial else torch.zeros(0, dtype=self.dtype)
        return [StateSpec("state", (init.numel(),), self.dtype, init.cpu())]

    def _linstates(self) -> list[LinStateLayer]:
        return [layer for layer in self.layers if isinstance(layer, LinStateLayer)]

    def run_vectors(
        self, x: torch.Tensor, cu_seqlens: torch.Tensor | None, state: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Program outputs ``[T, 1]`` for packed input vectors ``x`` ``[T, input_dim]``, and final states.

        ``cu_seqlens=None`` means one token per sequence (decode)."""
        finals, offset = [], 0
        for layer in self.layers:
            if isinstance(layer, LinStateLayer):
                size = len(layer.persistent)
                x, final = layer(x, cu_seqlens, state[:, offset : offset + size])
                finals.append(final)
                offset += size
            else:
                x = layer(x)
        return x, torch.cat(finals, dim=1) if finals else state

    def initial_state(self, batch: int) -> torch.Tensor:
        """``[batch, state_dim]`` fresh states (for running the model outside a state pool)."""
        spec = self.state_spec()[0]
        return spec.initial.to(self.embedding.device).expand(batch, -1).clone()

    def logits(self, y: torch.Tensor) -> torch.Tensor:
        """``-HEAD_SHARPNESS (y - v)^2`` for every token value ``v`` (``-inf`` for tokens without a value): the
        nearest value wins, and a program's answer is a sample's at any temperature (at unit scale, sampling at
        OpenAI's default temperature 1 picked the nearest token of a dictionary answer with p = 0.56).

        ``y`` is first clamped to one unit beyond the smallest and largest value, which keeps the nearest value:
        for an output as large as 1e20 (a state growing without bound) every squared distance rounded to the same
        number, and an infinite output made them all NaN."""
        v = self.token_values
        valueless = torch.isnan(v)
        lowest, highest = v.masked_fill(valueless, float("inf")).min(), v.masked_fill(valueless, -float("inf")).max()
        y = y.reshape(-1, 1).clamp(lowest - 1, highest + 1)  # no boolean indexing: no host sync on a GPU
        scores = -HEAD_SHARPNESS * (y - v) ** 2
        return scores.masked_fill(torch.isnan(v), float("-inf"))

    def _run(
        self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor | None, slot_ids: torch.Tensor, state: StateTensors
    ) -> torch.Tensor:
        """Program outputs for packed tokens, continuing from and writing back the states of ``slot_ids``."""
        pools = (state["state"],)
        y, final = self.run_vectors(self.embedding[input_ids], cu_seqlens, *gather_slots(pools, slot_ids))
        scatter_slots(pools, slot_ids, (final,))
        return y

    def prefill(self, batch: PrefillBatch, state: StateTensors) -> torch.Tensor:
        y = self._run(batch.input_ids, batch.cu_seqlens, batch.slot_ids, state)
        return self.logits(y[batch.logit_rows])

    def decode(self, batch: DecodeBatch, state: StateTensors) -> torch.Tensor:
        return self.logits(self._run(batch.input_ids, None, batch.slot_ids, state))
