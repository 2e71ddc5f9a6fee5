"""Lattice language models (Karami & Mirrokni, "Lattice: Learning to Efficiently Compress the Memory").

Each head compresses its context into ``m`` unit-norm memory slots, the columns of a state ``S [d, m]``,
updating each slot only with information orthogonal to it (the orthogonal state recurrence, Eq. 13, in the
DEC, ENC or SIM variant of Table 1; unit-sphere normalisation, Eq. 14; optional forget gate, Eq. 16; see
:mod:`rnnserve.kernels.lattice`). Block (pre-norm, residual), following the paper's App. A::

    q, k, v, g, gamma_logit (, mu_logit) = in_proj(RMSNorm(x))
    q, k   = l2norm_per_head(silu(conv1d_causal([q, k])))     # short convs on q and k, state: last K-1 rows
    gamma  = sigmoid(gamma_logit + gamma_bias)                  # per head and token ("softplus": softplus)
    mu     = sigmoid(mu_logit + mu_bias)                        # forget gate, only with forget_gate
    y      = Lattice(q, k, v, gamma, mu)                        # state: S [H, d, m], starts from S_0
    x      = x + out_proj(y * gelu(g))                          # GeLU output gate
    x      = x + GatedMLP(RMSNorm(x))                           # SwiGLU

The paper fixes neither how the step size ``gamma_t`` is produced nor whether q and k are normalised; our
choices (a per-head sigmoid of a projection of ``x_t`` plus a bias, config ``step_size``; L2-normalised q and k,
config ``qk_norm``) are documented here and in ``docs/models.md``. ``S_0`` (orthonormal columns, one per layer
and head) is a checkpoint parameter; a new request's slot starts from it, never from zeros.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
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
from rnnserve.engine.models.layers import GatedMLP, RMSNorm, gather_slots, linear, scatter_slots
from rnnserve.kernels.causal_conv1d import causal_conv1d_update, causal_conv1d_varlen
from rnnserve.kernels.gated_act import gated_act
from rnnserve.kernels.lattice import VARIANTS, lattice_decode, lattice_varlen
from rnnserve.kernels.residual_rms_norm import residual_rms_norm

STEP_SIZES = ("sigmoid", "softplus")


@dataclass
class LatticeConfig(ModelConfig):
    """``head_dim`` is ``d`` (a slot's length, the value and read-out width), ``num_slots`` is ``m`` (the key and
    query width); ``m <= d`` so that ``S_0`` can have orthonormal columns."""

    vocab_size: int = 320
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    head_dim: int = 64
    num_slots: int = 64
    variant: str = "dec"
    state_norm: bool = True
    forget_gate: bool = False
    step_size: str = "sigmoid"
    qk_norm: bool = True
    conv_kernel: int = 4
    mlp_width: int = 1024
    norm_eps: float = 1e-5
    tie_embeddings: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, got {self.variant!r}")
        if self.step_size not in STEP_SIZES:
            raise ValueError(f"step_size must be one of {STEP_SIZES}, got {self.step_size!r}")
        if self.num_slots > self.head_dim:
            raise ValueError(f"num_slots ({self.num_slots}) must be <= head_dim ({self.head_dim}): S_0 is orthonormal")

    @property
    def qk_width(self) -> int:
        return self.n_heads * self.num_slots

    @property
    def v_width(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def num_gates(self) -> int:
        return 2 if self.forget_gate else 1


def orthonormal_columns(*shape: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """A random ``[..., d, m]`` tensor whose ``m <= d`` columns are orthonormal (QR of a Gaussian)."""
    q, r = torch.linalg.qr(torch.randn(*shape, generator=generator, dtype=torch.float64))
    return (q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1))[..., None, :]).float()


class LatticeMixer(nn.Module):
    """The Lattice sequence mixer of one block (see the module docstring)."""

    def __init__(self, config: LatticeConfig) -> None:
        super().__init__()
        c = config
        self.config = c
        self.in_proj = nn.Linear(c.d_model, 2 * c.qk_width + 2 * c.v_width + c.num_gates * c.n_heads, bias=False)
        self.conv_weight = nn.Parameter(torch.empty(2 * c.qk_width, c.conv_kernel))
        self.conv_bias = nn.Parameter(torch.zeros(2 * c.qk_width))
        self.gate_bias = nn.Parameter(torch.zeros(c.num_gates * c.n_heads))
        self.out_proj = nn.Linear(c.v_width, c.d_model, bias=False)
        self.S0 = nn.Parameter(orthonormal_columns(c.n_heads, c.head_dim, c.num_slots))

    def initial_state(self) -> torch.Tensor:
        """``S_0 [H, d, m]`` in fp32 with each column renormalised (bf16 weights, or training, move it off the
        unit sphere)."""
        s0 = self.S0.float()
        return s0 / torch.linalg.vector_norm(s0, dim=-2, keepdim=True)

    def _split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``in_proj(x)`` -> ``(qk [R, 2 H m], v [R, H, d], g [R, H d], gamma [R, H], mu [R, H] | None)``."""
        c = self.config
        qk, v, g, gates = linear(self.in_proj, x).split(
            [2 * c.qk_width, c.v_width, c.v_width, c.num_gates * c.n_heads], dim=-1
        )
        gates = gates.float() + self.gate_bias.float()
        gamma = torch.sigmoid(gates[:, : c.n_heads]) if c.step_size == "sigmoid" else F.softplus(gates[:, : c.n_heads])
        mu = torch.sigmoid(gates[:, c.n_heads :]) if c.forget_gate else None
        return qk, v.reshape(-1, c.n_heads, c.head_dim), g, gamma, mu

    def _qk(self, qk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        q, k = qk.reshape(-1, 2, c.n_heads, c.num_slots).unbind(1)
        if c.qk_norm:
            q, k = F.normalize(q.float(), dim=-1), F.normalize(k.float(), dim=-1)
        return q, k

    def _out(self, y: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        return linear(self.out_proj, gated_act(g, y.reshape(g.shape).to(g.dtype), "gelu"))  # y * gelu(g)

    def prefill(
        self,
        x: torch.Tensor,
        cu_seqlens: torch.Tensor,
        conv_state: torch.Tensor,
        s_pool: torch.Tensor,
        slot_ids: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Packed normed rows ``x [T, D]``; ``conv_state [B, 2 H m, K-1]`` in -> ``(out [T, D], final conv)``.

        ``s_pool [N, H, d, m]`` is this layer's view of the state pool: rows ``slot_ids`` are read and written.
        """
        qk, v, g, gamma, mu = self._split(x)
        qk, conv_state = causal_conv1d_varlen(qk, self.conv_weight, self.conv_bias, cu_seqlens, conv_state, silu=True)
        q, k = self._qk(qk)
        c = self.config
        y = lattice_varlen(q, k, v, gamma, mu, cu_seqlens, s_pool, slot_ids, c.variant, c.state_norm)
        return self._out(y, g), conv_state

    def decode(
        self, x: torch.Tensor, slot_ids: torch.Tensor, conv_pool: torch.Tensor, s_pool: torch.Tensor
    ) -> torch.Tensor:
        """One token per row of ``x [B, D]``; rows ``slot_ids`` of both pool views are updated in place."""
        qk, v, g, gamma, mu = self._split(x)
        qk = causal_conv1d_update(qk, conv_pool, self.conv_weight, self.conv_bias, slot_ids, silu=True)
        q, k = self._qk(qk)
        c = self.config
        y = lattice_decode(q, k, v, gamma, mu, s_pool, slot_ids, c.variant, c.state_norm)
        return self._out(y, g)


class LatticeBlock(nn.Module):
    def __init__(self, config: LatticeConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(config.d_model, config.norm_eps)
        self.mixer = LatticeMixer(config)
        self.mlp_norm = RMSNorm(config.d_model, config.norm_eps)
        self.mlp = GatedMLP(config.d_model, config.mlp_width)


@register_model
class LatticeLM(RecurrentLM):
    """Embedding -> pre-norm blocks (Lattice mixer, gated MLP) -> RMSNorm -> LM head.

    States per slot: ``conv [L, 2 H m, K-1]`` (zeros) and ``S [L, H, d, m]`` (initially ``S_0``), fp32.
    """

    architecture = "lattice"
    config_class = LatticeConfig

    def __init__(self, config: LatticeConfig) -> None:
        super().__init__(config)
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.layers = nn.ModuleList(LatticeBlock(config) for _ in range(config.n_layers))
        self.norm_f = RMSNorm(config.d_model, config.norm_eps)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    def init_weights(self, generator: torch.Generator | None = None) -> None:
        super().init_weights(generator)
        c = self.config
        if c.tie_embeddings:
            nn.init.normal_(self.embed.weight, std=c.d_model**-0.5, generator=generator)
        for layer in self.layers:
            mixer = layer.mixer
            nn.init.normal_(mixer.conv_weight, std=c.conv_kernel**-0.5, generator=generator)
            nn.init.zeros_(mixer.conv_bias)
            nn.init.zeros_(mixer.gate_bias)
            if c.forget_gate:
                nn.init.constant_(mixer.gate_bias[c.n_heads :], 3.0)  # mu ~ 0.95: remember by default
            with torch.no_grad():
                mixer.S0.copy_(orthonormal_columns(c.n_heads, c.head_dim, c.num_slots, generator=generator))

    def initial_state(self) -> torch.Tensor:
        """Every layer's :meth:`LatticeMixer.initial_state`, ``[L, H, d, m]``: each slot's value at admission."""
        return torch.stack([layer.mixer.initial_state().detach() for layer in self.layers])

    def state_spec(self) -> list[StateSpec]:
        c = self.config
        return [
            StateSpec("conv", (c.n_layers, 2 * c.qk_width, c.conv_kernel - 1), torch.float32, 0.0),
            StateSpec("S", (c.n_layers, c.n_heads, c.head_dim, c.num_slots), torch.float32, self.initial_state()),
        ]

    def _add_norm(self, stream: torch.Tensor, delta: torch.Tensor | None, norm: RMSNorm) -> tuple[torch.Tensor, ...]:
        return residual_rms_norm(stream, delta, norm.weight, norm.eps)

    def _mlp(self, block: LatticeBlock, stream: torch.Tensor, mixed: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``stream + mixed`` then the block's MLP: returns ``(mlp_out, new_stream)``."""
        normed, stream = self._add_norm(stream, mixed, block.mlp_norm)
        return block.mlp(normed), stream

    def prefill(self, batch: PrefillBatch, state: StateTensors) -> torch.Tensor:
        conv_pool, s_pool = state["conv"], state["S"]
        (conv,) = gather_slots((conv_pool,), batch.slot_ids)
        stream, delta = self.embed(batch.input_ids), None
        for i, block in enumerate(self.layers):
            normed, stream = self._add_norm(stream, delta, block.norm)
            mixed, conv[:, i] = block.mixer.prefill(normed, batch.cu_seqlens, conv[:, i], s_pool[:, i], batch.slot_ids)
            delta, stream = self._mlp(block, stream, mixed)
        scatter_slots((conv_pool,), batch.slot_ids, (conv,))
        rows = batch.logit_rows  # only these rows need the final norm and logits
        normed, _ = self._add_norm(stream[rows], delta[rows], self.norm_f)
        return linear(self.lm_head, normed, widened=True).float()

    def decode(self, batch: DecodeBatch, state: StateTensors) -> torch.Tensor:
        conv_pool, s_pool = state["conv"], state["S"]
        stream, delta = self.embed(batch.input_ids), None
        for i, block in enumerate(self.layers):
            normed, stream = self._add_norm(stream, delta, block.norm)
            mixed = block.mixer.decode(normed, batch.slot_ids, conv_pool[:, i], s_pool[:, i])
            delta, stream = self._mlp(block, stream, mixed)
        normed, _ = self._add_norm(stream, delta, self.norm_f)
        return linear(self.lm_head, normed, widened=True).float()


register_preset("lattice-tiny", "lattice", d_model=64, n_layers=2, n_heads=2, head_dim=16, num_slots=8,
                mlp_width=128, vocab_size=320)
register_preset("lattice-enc-tiny", "lattice", d_model=64, n_layers=2, n_heads=2, head_dim=16, num_slots=8,
                mlp_width=128, vocab_size=320, variant="enc")
register_preset("lattice-sim-tiny", "lattice", d_model=64, n_layers=2, n_heads=2, head_dim=16, num_slots=8,
                mlp_width=128, vocab_size=320, variant="sim", forget_gate=True)
register_preset("lattice-110m", "lattice", d_model=768, n_layers=12, n_heads=12, head_dim=64, num_slots=64,
                mlp_width=1792, vocab_size=32000)
register_preset("lattice-340m", "lattice", d_model=1024, n_layers=24, n_heads=16, head_dim=64, num_slots=64,
                mlp_width=2432, vocab_size=32000)
