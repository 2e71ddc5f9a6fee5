"""Classic recurrent language models: Elman RNN (tanh/ReLU), LSTM and GRU with ``torch.nn`` semantics.

``embed -> torch.nn.RNN | LSTM | GRU (n_layers, batch_first) -> lm_head``. The recurrent stack *is* the
``torch.nn`` module, so weight names (``rnn.weight_ih_l0``, ``rnn.bias_hh_l1``, ...) and numerics are
PyTorch's. Prefill hands the packed batch to the module as a ``PackedSequence`` (time-major, no padding,
built from the batch's host lengths), so the whole time loop runs inside PyTorch's fused kernel (oneDNN on
CPU, cuDNN on GPU), and the head reads the batch's ``logit_rows`` of the top layer's outputs; decode is one
cell step: the module's on a GPU; on CPU the cells' equations over the module's weights, whose GEMMs go through
:func:`~rnnserve.engine.models.layers.matmul_t` (oneDNN's RNN primitive reorders an LSTM's weights at every
call: lstm-large, 72 MB a layer, decoded 20 tok/s at batch 1). State per layer: ``h`` (and ``c`` for LSTM),
stored in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence

from rnnserve.engine.models.base import (
    DecodeBatch,
    ModelConfig,
    PrefillBatch,
    RecurrentLM,
    StateSpec,
    StateTensors,
    register_model,
    register_preset,
)
from rnnserve.engine.models.layers import gather_slots, linear, matmul_t, scatter_slots, time_major_packed


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
        allowed = ("tanh", "relu") if self.rnn_class is nn.RNN else ("tanh",)  # torch.nn's LSTM and GRU: tanh only
        if c.nonlinearity not in allowed:
            raise ValueError(f"nonlinearity {c.nonlinearity!r} is not supported by {self.rnn_class.__name__} "
                             f"(supported: {', '.join(allowed)})")
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

    def _run(self, x: torch.Tensor | PackedSequence, slot_ids: torch.Tensor, state: StateTensors) -> torch.Tensor:
        """Run the stack over ``x`` from the states of ``slot_ids``, write the final states back and return the
        top layer's outputs (``torch.nn`` holds states as ``[n_layers, B, H]``)."""
        pools = [state[name] for name in self.state_names]
        dtype = self.embed.weight.dtype
        parts = tuple(p.transpose(0, 1).to(dtype).contiguous() for p in gather_slots(pools, slot_ids))
        output, hidden = self.rnn(x, parts if len(parts) == 2 else parts[0])
        parts = hidden if isinstance(hidden, tuple) else (hidden,)
        scatter_slots(pools, slot_ids, [p.transpose(0, 1) for p in parts])
        return output.data if isinstance(output, PackedSequence) else output[:, -1]

    def prefill(self, batch: PrefillBatch, state: StateTensors) -> torch.Tensor:
        """The packed outputs come back time-major; packing the row numbers the same way maps them back to
        the batch's rows, of which only ``logit_rows`` reach the head."""
        rows = torch.arange(batch.input_ids.shape[0], device=batch.input_ids.device)
        packed_rows = time_major_packed(rows, batch.lengths).data
        out = self._run(time_major_packed(self.embed(batch.input_ids), batch.lengths), batch.slot_ids, state)
        hidden = out.new_empty(out.shape).index_copy_(0, packed_rows, out)
        return linear(self.lm_head, hidden[batch.logit_rows], widened=True).float()

    def decode(self, batch: DecodeBatch, state: StateTensors) -> torch.Tensor:
        x = self.embed(batch.input_ids)
        if x.device.type == "cpu":
            top = self._step(x, batch.slot_ids, state)
        else:
            top = self._run(x[:, None, :], batch.slot_ids, state)
        return linear(self.lm_head, top, widened=True).float()

    def _layer_weights(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """``(weight_ih, weight_hh, bias_ih, bias_hh)`` of one layer of the module (biases None without them)."""
        rnn = self.rnn
        biases = (getattr(rnn, f"bias_ih_l{layer}"), getattr(rnn, f"bias_hh_l{layer}")) if rnn.bias else (None, None)
        return getattr(rnn, f"weight_ih_l{layer}"), getattr(rnn, f"weight_hh_l{layer}"), *biases

    def _cell(
        self, gates_x: torch.Tensor, gates_h: torch.Tensor, h: torch.Tensor, c: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One cell step from the input's and the state's gate pre-activations -> ``(h, c)``."""
        raise NotImplementedError

    def _step(self, x: torch.Tensor, slot_ids: torch.Tensor, state: StateTensors) -> torch.Tensor:
        """One token per row through every layer's cell (``torch.nn``'s equations), reading and writing the
        states of ``slot_ids`` as :meth:`_run` does; returns the top layer's ``h``."""
        pools = [state[name] for name in self.state_names]
        dtype = x.dtype
        parts = [p.to(dtype) for p in gather_slots(pools, slot_ids)]  # [B, n_layers, H] each
        news = [torch.empty_like(p) for p in parts]
        for layer in range(self.config.n_layers):
            w_ih, w_hh, b_ih, b_hh = self._layer_weights(layer)
            h = parts[0][:, layer]
            c = parts[1][:, layer] if len(parts) == 2 else None
            x, c = self._cell(matmul_t(x, w_ih, b_ih), matmul_t(h, w_hh, b_hh), h, c)
            news[0][:, layer] = x
            if c is not None:
                news[1][:, layer] = c
        scatter_slots(pools, slot_ids, news)
        return x


@register_model
class ElmanRNNLM(ClassicRNNLM):
    """Elman RNN: ``h_t = act(W_ih x_t + b_ih + W_hh h_{t-1} + b_hh)``, ``act`` = tanh or ReLU."""

    architecture = "rnn"
    rnn_class = nn.RNN

    def _cell(
        self, gates_x: torch.Tensor, gates_h: torch.Tensor, h: torch.Tensor, c: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        activation = torch.tanh if self.config.nonlinearity == "tanh" else torch.relu
        return activation(gates_x + gates_h), None


@register_model
class LSTMLM(ClassicRNNLM):
    architecture = "lstm"
    rnn_class = nn.LSTM

    def _cell(
        self, gates_x: torch.Tensor, gates_h: torch.Tensor, h: torch.Tensor, c: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        i, f, g, o = (gates_x + gates_h).chunk(4, dim=-1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        return torch.sigmoid(o) * torch.tanh(c), c


@register_model
class GRULM(ClassicRNNLM):
    architecture = "gru"
    rnn_class = nn.GRU

    def _cell(
        self, gates_x: torch.Tensor, gates_h: torch.Tensor, h: torch.Tensor, c: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        x_r, x_z, x_n = gates_x.chunk(3, dim=-1)
        h_r, h_z, h_n = gates_h.chunk(3, dim=-1)
        r, z = torch.sigmoid(x_r + h_r), torch.sigmoid(x_z + h_z)
        n = torch.tanh(x_n + r * h_n)
        return (1 - z) * n + z * h, None


for _arch in ("rnn", "lstm", "gru"):
    register_preset(f"{_arch}-tiny", _arch, vocab_size=320, d_embed=64, hidden_size=64, n_layers=2)
    # Zaremba et al. (2014) medium and large Penn Treebank LSTMs: 2 layers of 650 / 1500 units, 10k words.
    register_preset(f"{_arch}-medium", _arch, vocab_size=10000, d_embed=650, hidden_size=650, n_layers=2)
    register_preset(f"{_arch}-large", _arch, vocab_size=10000, d_embed=1500, hidden_size=1500, n_layers=2)
register_preset(
    "rnn-relu-tiny", "rnn", vocab_size=320, d_embed=64, hidden_size=64, n_layers=2, nonlinearity="relu"
)
