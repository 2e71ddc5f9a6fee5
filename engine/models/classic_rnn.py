"""Classic recurrent language models: Elman RNN (tanh/ReLU), LSTM and GRU with ``torch.nn`` semantics.

``embed -> torch.nn.RNN | LSTM | GRU (n_layers, batch_first) -> lm_head``. The recurrent stack *is* the
``torch.nn`` module, so weight names (``rnn.weight_ih_l0``, ``rnn.bias_hh_l1``, ...) and numerics are
PyTorch's. Prefill hands the packed batch to the module as a ``PackedSequence`` (time-major, no padding),
so the whole time loop runs inside PyTorch's fused kernel (oneDNN on CPU, cuDNN on GPU); decode is one
cell step. State per layer: ``h`` (and ``c`` for LSTM), stored in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence

from rnnserve.engine.models.base import (
    ModelConfig,
    RecurrentLM,
    StateSpec,
    StateTensors,
    register_model,
    register_preset,
)
from rnnserve.kernels.selective_scan import time_major_order


@dataclass
class ClassicRNNConfig(ModelConfig):
    vocab_size: int = 320
    d_embed: int = 256
    hidden_size: int = 256
    n_layers: int = 2
    nonlinearity: str = "tanh"
    bias: bool = True
    tie_embeddings: bool = False


class ClassicRNNLM(RecurrentLM):
    """Shared language model around one ``torch.nn`` recurrent stack."""

    config_class = ClassicRNNConfig
    rnn_class: type[nn.RNNBase]

    def __init__(self, config: ClassicRNNConfig) -> None:
        super().__init__(config)
        c = config
        if c.tie_embeddings and c.d_embed != c.hidden_size:
            raise ValueError("tie_embeddings needs d_embed == hidden_size")
        self.embed = nn.Embedding(c.vocab_size, c.d_embed)
        kwargs = {"nonlinearity": c.nonlinearity} if self.rnn_class is nn.RNN else {}
        self.rnn = self.rnn_class(
            c.d_embed, c.hidden_size, c.n_layers, bias=c.bias, batch_first=True, **kwargs
        )
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=True)
        if c.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    @property
    def state_names(self) -> tuple[str, ...]:
        return ("h", "c") if self.rnn_class is nn.LSTM else ("h",)

    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """``torch.nn``'s recurrent init (uniform in +-1/sqrt(hidden)), scaled embeddings and head."""
        bound = self.config.hidden_size**-0.5
        for p in self.rnn.parameters():
            nn.init.uniform_(p, -bound, bound, generator=generator)
        nn.init.normal_(self.embed.weight, std=1.0, generator=generator)
        if not self.config.tie_embeddings:
            nn.init.normal_(self.lm_head.weight, std=bound, generator=generator)
        nn.init.zeros_(self.lm_head.bias)

    def state_spec(self) -> list[StateSpec]:
        c = self.config
        return [StateSpec(name, (c.n_layers, c.hidden_size), torch.float32, 0.0) for name in self.state_names]

    def _gather(
        self, state: StateTensors, slot_ids: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor | tuple:
        """Pool rows -> ``torch.nn`` hidden state ``[n_layers, B, H]`` (a tuple ``(h, c)`` for LSTM)."""
        parts = tuple(state[n][slot_ids].transpose(0, 1).to(dtype).contiguous() for n in self.state_names)
        return parts if len(parts) == 2 else parts[0]

    def _scatter(
        self, state: StateTensors, slot_ids: torch.Tensor, hidden: torch.Tensor | tuple
    ) -> torch.Tensor:
        """Write the new hidden state back; returns the top layer's ``h [B, H]``."""
        parts = hidden if isinstance(hidden, tuple) else (hidden,)
        for name, part in zip(self.state_names, parts, strict=True):
            state[name][slot_ids] = part.transpose(0, 1).float()
        return parts[0][-1]

    def prefill(
        self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor, slot_ids: torch.Tensor, state: StateTensors
    ) -> torch.Tensor:
        active, rows, order = time_major_order(cu_seqlens)
        sorted_indices = torch.tensor(order, dtype=torch.long, device=input_ids.device)
        unsorted_indices = torch.empty_like(sorted_indices)
        unsorted_indices[sorted_indices] = torch.arange(len(order), device=input_ids.device)
        packed = PackedSequence(
            self.embed(input_ids[rows]),
            torch.tensor(active, dtype=torch.long),
            sorted_indices,
            unsorted_indices,
        )
        x_dtype = packed.data.dtype
        _, hidden = self.rnn(packed, self._gather(state, slot_ids, x_dtype))
        return self.lm_head(self._scatter(state, slot_ids, hidden)).float()

    def decode(self, input_ids: torch.Tensor, slot_ids: torch.Tensor, state: StateTensors) -> torch.Tensor:
        x = self.embed(input_ids)[:, None, :]
        _, hidden = self.rnn(x, self._gather(state, slot_ids, x.dtype))
        return self.lm_head(self._scatter(state, slot_ids, hidden)).float()


@register_model
class ElmanRNNLM(ClassicRNNLM):
    """Elman RNN: ``h_t = act(W_ih x_t + b_ih + W_hh h_{t-1} + b_hh)``, ``act`` = tanh or ReLU."""

    architecture = "rnn"
    rnn_class = nn.RNN


@register_model
class LSTMLM(ClassicRNNLM):
    architecture = "lstm"
    rnn_class = nn.LSTM


@register_model
class GRULM(ClassicRNNLM):
    architecture = "gru"
    rnn_class = nn.GRU


for _arch in ("rnn", "lstm", "gru"):
    register_preset(f"{_arch}-tiny", _arch, vocab_size=320, d_embed=64, hidden_size=64, n_layers=2)
    # Zaremba et al. (2014) medium and large Penn Treebank LSTMs: 2 layers of 650 / 1500 units, 10k words.
    register_preset(f"{_arch}-medium", _arch, vocab_size=10000, d_embed=650, hidden_size=650, n_layers=2)
    register_preset(f"{_arch}-large", _arch, vocab_size=10000, d_embed=1500, hidden_size=1500, n_layers=2)
register_preset(
    "rnn-relu-tiny", "rnn", vocab_size=320, d_embed=64, hidden_size=64, n_layers=2, nonlinearity="relu"
)
