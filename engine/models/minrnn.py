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
import torch.nn.functional as F
from torch import nn

from engine.models.base import ModelConfig, RecurrentLM, StateSpec, StateTensors, register_model, register_preset
from kernels.causal_conv1d import causal_conv1d_update_ref, causal_conv1d_varlen_ref
from kernels.diag_linear_scan import diag_log_scan_ref


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


def g(x: torch.Tensor) -> torch.Tensor:
    """The paper's positive candidate activation: ``x + 0.5`` for ``x >= 0`` else ``sigmoid(x)``."""
    return torch.where(x >= 0, x + 0.5, torch.sigmoid(x))


def log_g(x: torch.Tensor) -> torch.Tensor:
    """``log(g(x))`` computed stably."""
    return torch.where(x >= 0, torch.log(F.relu(x) + 0.5), -F.softplus(-x))


class MinGRUCell(nn.Module):
    """minGRU: ``z = sigmoid(k)``, ``h_t = (1 - z) h_{t-1} + z g(h~)``."""

    num_projections = 2

    @staticmethod
    def log_coefficients(proj: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k, candidate = proj.float().chunk(2, dim=-1)
        return -F.softplus(k), -F.softplus(-k) + log_g(candidate)

    @staticmethod
    def coefficients(proj: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k, candidate = proj.float().chunk(2, dim=-1)
        z = torch.sigmoid(k)
        return 1.0 - z, z * g(candidate)


class MinLSTMCell(nn.Module):
    """minLSTM: normalised forget/input gates ``f' = f/(f+i)``, ``i' = i/(f+i)``; ``h_t = f' h + i' g(h~)``."""

    num_projections = 3

    @staticmethod
    def _gate_diff(f: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        return F.softplus(-f) - F.softplus(-i)

    @classmethod
    def log_coefficients(cls, proj: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        f, i, candidate = proj.float().chunk(3, dim=-1)
        diff = cls._gate_diff(f, i)
        return -F.softplus(diff), -F.softplus(-diff) + log_g(candidate)

    @classmethod
    def coefficients(cls, proj: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        f, i, candidate = proj.float().chunk(3, dim=-1)
        diff = cls._gate_diff(f, i)
        return torch.sigmoid(-diff), torch.sigmoid(diff) * g(candidate)


class MinRNNBlock(nn.Module):
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

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp_out(F.gelu(self.mlp_in(self.norm2(x))))

    def prefill(
        self, x: torch.Tensor, cu_seqlens: torch.Tensor, conv_state: torch.Tensor, h: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        u, conv_state = causal_conv1d_varlen_ref(self.norm1(x), self.conv_weight, self.conv_bias, cu_seqlens, conv_state)
        log_a, log_b = self.cell.log_coefficients(self.in_proj(u))
        hidden, h = diag_log_scan_ref(log_a, log_b, cu_seqlens, h, chunk_size=self.scan_chunk_size)
        x = x + self.out_proj(hidden.to(x.dtype))
        return self._mlp(x), conv_state, h

    def decode(
        self, x: torch.Tensor, conv_state: torch.Tensor, h: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        u, conv_state = causal_conv1d_update_ref(self.norm1(x), conv_state, self.conv_weight, self.conv_bias)
        a, b = self.cell.coefficients(self.in_proj(u))
        h = a * h + b
        x = x + self.out_proj(h.to(x.dtype))
        return self._mlp(x), conv_state, h


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

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm_f(x)).float()

    def prefill(
        self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor, slot_ids: torch.Tensor, state: StateTensors
    ) -> torch.Tensor:
        conv, h = state["conv"][slot_ids], state["h"][slot_ids]
        x = self.embed(input_ids)
        for i, layer in enumerate(self.layers):
            x, conv[:, i], h[:, i] = layer.prefill(x, cu_seqlens, conv[:, i], h[:, i])
        state["conv"][slot_ids] = conv
        state["h"][slot_ids] = h
        return self._logits(x[cu_seqlens[1:] - 1])

    def decode(self, input_ids: torch.Tensor, slot_ids: torch.Tensor, state: StateTensors) -> torch.Tensor:
        conv, h = state["conv"][slot_ids], state["h"][slot_ids]
        x = self.embed(input_ids)
        for i, layer in enumerate(self.layers):
            x, conv[:, i], h[:, i] = layer.decode(x, conv[:, i], h[:, i])
        state["conv"][slot_ids] = conv
        state["h"][slot_ids] = h
        return self._logits(x)


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
