"""minGRU and minLSTM language models ("Were RNNs All We Needed?", Sec. 3 and App. B).

Block (pre-norm, residual), as in the paper's language-model setup::

    u = conv1d_causal(LayerNorm(x))          # depthwise, kernel 4, state: last 3 inputs
    x = x + out_proj(min_rnn(in_proj(u)))    # hidden size expansion * d_model, state: h
    x = x + MLP(LayerNorm(x))                # two layers, GELU

Both cells use the log-space formulation the paper trained (candidate ``g(h~) > 0``, so ``h > 0``).

Initial-state convention (one for both paths): the slot stores the linear-space hidden state ``h``
and a new request starts from ``h = 0``. Decode applies ``h_t = a_t * h_{t-1} + b_t`` directly; prefill
runs the log-space scan seeded with ``log(h_{t-1})`` (``-inf`` for a new request). The paper's parallel
code seeds the scan with ``log_g(h0)`` instead, i.e. starts from ``g(0) = 0.5``, which disagrees with its
own sequential code; we never apply ``g`` to a stored state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

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
from rnnserve.engine.models.layers import gather_slots, linear, scatter_slots
from rnnserve.kernels.add_norm import add_norm
from rnnserve.kernels.causal_conv1d import causal_conv1d_update, causal_conv1d_varlen
from rnnserve.kernels.gated_act import gated_act
from rnnserve.kernels.min_rnn_step import (
    g,
    log_g,
    min_rnn_scan,
    min_rnn_step,
    mingru_coefficients,
    mingru_log_coefficients,
    minlstm_coefficients,
    minlstm_log_coefficients,
)

__all__ = ["MinRNNConfig", "MinGRUCell", "MinLSTMCell", "MinRNNBlock", "MinGRULM", "MinLSTMLM", "g", "log_g"]


@dataclass
class MinRNNConfig(ModelConfig):
    vocab_size: int = 320
    d_model: int = 384
    n_layers: int = 3
    expansion: int = 2
    conv_kernel: int = 4
    mlp_ratio: int = 4
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    scan_chunk_size: int = 64

    @property
    def d_hidden(self) -> int:
        return self.expansion * self.d_model


class MinGRUCell(nn.Module):
    """minGRU: ``z = sigmoid(k)``, ``h_t = (1 - z) h_{t-1} + z g(h~)``."""

    name = "mingru"
    num_projections = 2
    coefficients = staticmethod(mingru_coefficients)
    log_coefficients = staticmethod(mingru_log_coefficients)


class MinLSTMCell(nn.Module):
    """minLSTM: normalised gates ``f' = f/(f+i)``, ``i' = i/(f+i)``; ``h_t = f' h + i' g(h~)``."""

    name = "minlstm"
    num_projections = 3
    coefficients = staticmethod(minlstm_coefficients)
    log_coefficients = staticmethod(minlstm_log_coefficients)


def _add_norm(
    norm: nn.LayerNorm, delta: torch.Tensor, stream: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``stream += delta`` then ``norm(stream)``, fused on CUDA: returns ``(normed, stream)``."""
    return add_norm(delta, stream, norm.weight, norm.bias, norm.eps)


class MinRNNBlock(nn.Module):
    """One pre-norm block.

    ``prefill``/``decode`` take and return the residual stream as ``(delta, stream)``: the block's output is
    ``stream + delta``, the add being fused into the next norm (``stream`` is None before the first block).
    """

    def __init__(self, config: MinRNNConfig, cell: type[MinGRUCell] | type[MinLSTMCell]) -> None:
        super().__init__()
        d, dh = config.d_model, config.d_hidden
        self.cell = cell
        self.norm1 = nn.LayerNorm(d, eps=config.norm_eps)
        self.conv_weight = nn.Parameter(torch.empty(d, config.conv_kernel))
        self.conv_bias = nn.Parameter(torch.zeros(d))
        self.in_proj = nn.Linear(d, cell.num_projections * dh, bias=False)
        self.out_proj = nn.Linear(dh, d, bias=False)
        self.norm2 = nn.LayerNorm(d, eps=config.norm_eps)
        self.mlp_in = nn.Linear(d, config.mlp_ratio * d)
        self.mlp_out = nn.Linear(config.mlp_ratio * d, d)
        self.scan_chunk_size = config.scan_chunk_size

    def mlp(self, normed: torch.Tensor) -> torch.Tensor:
        return linear(self.mlp_out, gated_act(linear(self.mlp_in, normed), None, "gelu"))

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        """Unfused ``x + MLP(norm2(x))`` on a dense residual stream (used by the training script)."""
        return x + self.mlp(self.norm2(x))

    def _mix_then_mlp(self, mixed: torch.Tensor, stream: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        normed, stream = _add_norm(self.norm2, linear(self.out_proj, mixed), stream)
        return self.mlp(normed), stream

    def prefill(
        self,
        delta: torch.Tensor,
        stream: torch.Tensor | None,
        cu_seqlens: torch.Tensor,
        conv_state: torch.Tensor,
        h: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Packed tokens; ``conv_state [B, C, K-1]``, ``h [B, Dh]`` in, final states out (not in place)."""
        normed, stream = _add_norm(self.norm1, delta, stream)
        u, conv_state = causal_conv1d_varlen(normed, self.conv_weight, self.conv_bias, cu_seqlens, conv_state)
        hidden, h = min_rnn_scan(linear(self.in_proj, u), cu_seqlens, h, self.cell.name, self.scan_chunk_size)
        delta, stream = self._mix_then_mlp(hidden.to(stream.dtype), stream)
        return delta, stream, conv_state, h

    def decode(
        self,
        delta: torch.Tensor,
        stream: torch.Tensor | None,
        slot_ids: torch.Tensor,
        conv_pool: torch.Tensor,
        h_pool: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One token per row; updates rows ``slot_ids`` of this layer's pool views in place.

        ``conv_pool [N, C, K-1]`` and ``h_pool [N, Dh]`` are views such as ``state["h"][:, layer]``.
        """
        normed, stream = _add_norm(self.norm1, delta, stream)
        u = causal_conv1d_update(normed, conv_pool, self.conv_weight, self.conv_bias, slot_ids)
        hidden = min_rnn_step(linear(self.in_proj, u), h_pool, slot_ids, self.cell.name)
        return self._mix_then_mlp(hidden, stream)


class MinRNNLM(RecurrentLM):
    """Shared language model around a minGRU or minLSTM cell."""

    config_class = MinRNNConfig
    cell: type[MinGRUCell] | type[MinLSTMCell]

    def __init__(self, config: MinRNNConfig) -> None:
        super().__init__(config)
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.layers = nn.ModuleList(MinRNNBlock(config, self.cell) for _ in range(config.n_layers))
        self.norm_f = nn.LayerNorm(config.d_model, eps=config.norm_eps)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    def init_weights(self, generator: torch.Generator | None = None) -> None:
        super().init_weights(generator)
        for layer in self.layers:
            nn.init.normal_(layer.conv_weight, std=self.config.conv_kernel**-0.5, generator=generator)
            nn.init.zeros_(layer.conv_bias)
        if self.config.tie_embeddings:
            nn.init.normal_(self.embed.weight, std=self.config.d_model**-0.5, generator=generator)

    def state_spec(self) -> list[StateSpec]:
        c = self.config
        return [
            StateSpec("conv", (c.n_layers, c.d_model, c.conv_kernel - 1), torch.float32, 0.0),
            StateSpec("h", (c.n_layers, c.d_hidden), torch.float32, 0.0),
        ]

    def _logits(self, delta: torch.Tensor, stream: torch.Tensor) -> torch.Tensor:
        normed, _ = _add_norm(self.norm_f, delta, stream)
        return linear(self.lm_head, normed, widened=True).float()

    def prefill(self, batch: PrefillBatch, state: StateTensors) -> torch.Tensor:
        pools = state["conv"], state["h"]
        conv, h = gather_slots(pools, batch.slot_ids)
        delta, stream = self.embed(batch.input_ids), None
        for i, layer in enumerate(self.layers):
            delta, stream, conv[:, i], h[:, i] = layer.prefill(delta, stream, batch.cu_seqlens, conv[:, i], h[:, i])
        scatter_slots(pools, batch.slot_ids, (conv, h))
        last = batch.logit_rows
        return self._logits(delta[last], stream[last])

    def decode(self, batch: DecodeBatch, state: StateTensors) -> torch.Tensor:
        """Reads and writes each layer's state slots in place (fused kernels on CUDA); graph-capturable."""
        conv_pool, h_pool = state["conv"], state["h"]
        delta, stream = self.embed(batch.input_ids), None
        for i, layer in enumerate(self.layers):
            delta, stream = layer.decode(delta, stream, batch.slot_ids, conv_pool[:, i], h_pool[:, i])
        return self._logits(delta, stream)


@register_model
class MinGRULM(MinRNNLM):
    architecture = "mingru"
    cell = MinGRUCell


@register_model
class MinLSTMLM(MinRNNLM):
    architecture = "minlstm"
    cell = MinLSTMCell


for _arch in ("mingru", "minlstm"):
    register_preset(f"{_arch}-tiny", _arch, d_model=64, n_layers=2, vocab_size=320)
    register_preset(f"{_arch}-paper", _arch, d_model=384, n_layers=3, vocab_size=320)
    register_preset(f"{_arch}-100m", _arch, d_model=768, n_layers=12, vocab_size=320)
    register_preset(f"{_arch}-1b", _arch, d_model=2048, n_layers=18, vocab_size=32000)
