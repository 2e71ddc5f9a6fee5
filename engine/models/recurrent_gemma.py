"""RecurrentGemma: Griffin (RG-LRU recurrent blocks + local sliding-window attention), Hawk (recurrent only).

Hugging Face ``RecurrentGemmaForCausalLM`` layout and numerics. Residual block::

    h = h + temporal_block(RMSNorm(h))            # RMSNorm scales by (1 + weight)
    h = h + mlp(RMSNorm(h))                       # down(gelu_tanh(gate(x)) * up(x))

Recurrent block: ``linear_out(RG-LRU(conv1d(linear_x(x))) * gelu_tanh(linear_y(x)))`` with, per channel,
``a = exp(-8 sigmoid(W_a x + b_a) softplus(Λ))``, ``h = a * h + sqrt(1 - a^2) * sigmoid(W_x x + b_x) * x``
(gate weights block-diagonal per head; at a sequence's first token the ``sqrt(1 - a^2)`` factor is 1).
Attention block: multi-query/GQA attention over the last ``window`` positions, RoPE on the first
``rotary_dim`` channels of each head. Embeddings are scaled by ``sqrt(hidden)`` rounded to bf16; logits
are soft-capped with ``cap * tanh(logits / cap)``.

State per slot (constant size): per recurrent layer the conv tail and the RG-LRU state (fp32), per attention
layer a ring buffer of the ``window - 1`` keys and values before the next token (position ``p`` at row
``p % (window - 1)``, RoPE already applied; :mod:`rnnserve.engine.models.layers.sliding_window`). Positions come
from the batch: RoPE and the attention window use them, and the RG-LRU starts afresh at position 0.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from rnnserve.engine.models.base import (
    DecodeBatch,
    ModelConfig,
    PrefillBatch,
    RecurrentLM,
    StateSpec,
    StateTensors,
    config_bool,
    register_model,
    register_preset,
)
from rnnserve.engine.models.layers import (
    GatedMLP,
    GemmaRMSNorm,
    SlidingWindowAttention,
    apply_rope,
    gather_slots,
    gelu_tanh,
    linear,
    rope_cos_sin,
    scatter_slots,
)
from rnnserve.kernels.causal_conv1d import causal_conv1d_update, causal_conv1d_varlen
from rnnserve.kernels.gated_act import gated_act
from rnnserve.kernels.rg_lru import rg_lru_scan, rg_lru_step
from rnnserve.kernels.soft_cap import soft_cap


@dataclass
class RecurrentGemmaConfig(ModelConfig):
    vocab_size: int = 256000
    hidden_size: int = 2560
    n_layers: int = 26
    mlp_width: int = 7680
    n_heads: int = 10
    n_kv_heads: int = 1
    head_dim: int = 256
    lru_width: int = 2560
    conv_width: int = 4
    window: int = 2048
    block_types: list[str] = field(default_factory=lambda: ["recurrent", "recurrent", "attention"])
    rope_theta: float = 10000.0
    rotary_dim: int = 128
    logits_soft_cap: float = 30.0
    norm_eps: float = 1e-6
    attention_bias: bool = False
    tie_embeddings: bool = True

    def layer_kinds(self) -> list[str]:
        """``block_types`` repeated over the depth."""
        return [self.block_types[i % len(self.block_types)] for i in range(self.n_layers)]


class RGLRU(nn.Module):
    """Real-gated linear recurrent unit; gate weights are block-diagonal with ``n_heads`` blocks."""

    def __init__(self, config: RecurrentGemmaConfig) -> None:
        super().__init__()
        heads, width = config.n_heads, config.lru_width // config.n_heads
        self.recurrent_param = nn.Parameter(torch.empty(config.lru_width))
        self.input_gate_weight = nn.Parameter(torch.empty(heads, width, width))
        self.input_gate_bias = nn.Parameter(torch.empty(heads, width))
        self.recurrent_gate_weight = nn.Parameter(torch.empty(heads, width, width))
        self.recurrent_gate_bias = nn.Parameter(torch.empty(heads, width))

    def gate_weights(self) -> tuple[torch.Tensor, ...]:
        """``(input_gate_weight, input_gate_bias, recurrent_gate_weight, recurrent_gate_bias, recurrent_param)``,
        as :mod:`rnnserve.kernels.rg_lru` takes them."""
        return (self.input_gate_weight, self.input_gate_bias, self.recurrent_gate_weight, self.recurrent_gate_bias,
                self.recurrent_param)  # fmt: skip


class RecurrentBlock(nn.Module):
    def __init__(self, config: RecurrentGemmaConfig) -> None:
        super().__init__()
        c = config
        self.linear_y = nn.Linear(c.hidden_size, c.lru_width)
        self.linear_x = nn.Linear(c.hidden_size, c.lru_width)
        self.linear_out = nn.Linear(c.lru_width, c.hidden_size)
        self.conv_1d = nn.Conv1d(c.lru_width, c.lru_width, c.conv_width, groups=c.lru_width)
        self.rg_lru = RGLRU(c)

    def prefill(
        self,
        x: torch.Tensor,
        cu_seqlens: torch.Tensor,
        first: torch.Tensor,
        conv_state: torch.Tensor,
        lru_state: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        u, conv_state = causal_conv1d_varlen(
            linear(self.linear_x, x), self.conv_1d.weight[:, 0], self.conv_1d.bias, cu_seqlens, conv_state
        )
        h, lru_state = rg_lru_scan(u, first, cu_seqlens, lru_state, *self.rg_lru.gate_weights())
        gated = gated_act(linear(self.linear_y, x), h.to(x.dtype), "gelu_tanh")  # h * gelu_tanh(linear_y(x))
        return linear(self.linear_out, gated), conv_state, lru_state

    def decode(
        self,
        x: torch.Tensor,
        slot_ids: torch.Tensor,
        first: torch.Tensor,
        conv_pool: torch.Tensor,
        lru_pool: torch.Tensor,
    ) -> torch.Tensor:
        y = gelu_tanh(linear(self.linear_y, x))
        u = causal_conv1d_update(
            linear(self.linear_x, x), conv_pool, self.conv_1d.weight[:, 0], self.conv_1d.bias, slot_ids
        )
        return linear(self.linear_out, rg_lru_step(u, y, first, *self.rg_lru.gate_weights(), lru_pool, slot_ids))


class LocalAttention(nn.Module):
    """Q/K/V projections and RoPE around :class:`~rnnserve.engine.models.layers.SlidingWindowAttention`."""

    def __init__(self, config: RecurrentGemmaConfig) -> None:
        super().__init__()
        c = config
        self.q_proj = nn.Linear(c.hidden_size, c.n_heads * c.head_dim, bias=c.attention_bias)
        self.k_proj = nn.Linear(c.hidden_size, c.n_kv_heads * c.head_dim, bias=c.attention_bias)
        self.v_proj = nn.Linear(c.hidden_size, c.n_kv_heads * c.head_dim, bias=c.attention_bias)
        self.o_proj = nn.Linear(c.n_heads * c.head_dim, c.hidden_size, bias=True)
        self.attention = SlidingWindowAttention(c.n_heads, c.n_kv_heads, c.head_dim, c.window)

    def _qkv(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Projections of ``x [N, hidden]`` into heads, RoPE (``cos, sin`` at the tokens' positions) on q and k."""
        a = self.attention
        q = linear(self.q_proj, x).reshape(-1, a.n_heads, a.head_dim)
        k = linear(self.k_proj, x).reshape(-1, a.n_kv_heads, a.head_dim)
        v = linear(self.v_proj, x).reshape(-1, a.n_kv_heads, a.head_dim)
        return apply_rope(q, *rope), apply_rope(k, *rope), v

    def prefill(
        self,
        x: torch.Tensor,
        batch: PrefillBatch,
        rope: tuple[torch.Tensor, torch.Tensor],
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        """``k_cache, v_cache [B, W, Hkv, d]`` hold each sequence's ring buffer; updated in place."""
        out = self.attention.prefill(*self._qkv(x, rope), batch, k_cache, v_cache)
        return linear(self.o_proj, out.to(x.dtype))

    def decode(
        self,
        x: torch.Tensor,
        batch: DecodeBatch,
        rope: tuple[torch.Tensor, torch.Tensor],
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
    ) -> torch.Tensor:
        """One token per sequence; this layer's pool views ``k_pool, v_pool`` are updated in place."""
        out = self.attention.decode(*self._qkv(x, rope), batch.positions, batch.slot_ids, k_pool, v_pool)
        return linear(self.o_proj, out.to(x.dtype))


class ResidualBlock(nn.Module):
    def __init__(self, config: RecurrentGemmaConfig, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.temporal_pre_norm = GemmaRMSNorm(config.hidden_size, config.norm_eps)
        self.temporal_block = RecurrentBlock(config) if kind == "recurrent" else LocalAttention(config)
        self.channel_pre_norm = GemmaRMSNorm(config.hidden_size, config.norm_eps)
        self.mlp_block = GatedMLP(config.hidden_size, config.mlp_width, "gelu_tanh", bias=True)

    def channel_mix(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.mlp_block(self.channel_pre_norm(h))


class Backbone(nn.Module):
    def __init__(self, config: RecurrentGemmaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(ResidualBlock(config, kind) for kind in config.layer_kinds())
        self.final_norm = GemmaRMSNorm(config.hidden_size, config.norm_eps)


@register_model
class RecurrentGemmaLM(RecurrentLM):
    """Griffin / Hawk in the ``RecurrentGemmaForCausalLM`` layout."""

    architecture = "recurrent_gemma"
    config_class = RecurrentGemmaConfig
    hf_model_types = ("recurrent_gemma",)

    def __init__(self, config: RecurrentGemmaConfig) -> None:
        super().__init__(config)
        unknown = sorted(set(config.block_types) - {"recurrent", "attention"})
        if unknown:
            raise ValueError(f"unknown block types {unknown}")
        if config.lru_width % config.n_heads:
            raise ValueError(f"lru_width {config.lru_width} is not a multiple of n_heads {config.n_heads}")
        self.model = Backbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        kinds = config.layer_kinds()
        # Index of each layer within its kind's state tensors.
        self._state_index = [kinds[:i].count(kind) for i, kind in enumerate(kinds)]
        self._num = {kind: kinds.count(kind) for kind in ("recurrent", "attention")}
        self.embed_scale = float(torch.tensor(config.hidden_size**0.5, dtype=torch.bfloat16, device="cpu"))

    @classmethod
    def from_hf_config(cls, hf: Mapping[str, Any]) -> RecurrentGemmaConfig:
        """Map a Hugging Face ``recurrent_gemma`` config.json to :class:`RecurrentGemmaConfig`."""
        if hf.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
            raise ValueError(f"hidden_activation {hf['hidden_activation']!r} is not supported")
        hidden, heads = hf["hidden_size"], hf["num_attention_heads"]
        # transformers computes hidden_size / num_attention_heads, then sets the config's keys over it: a head_dim
        # in config.json is the one its attention (q, k, v widths, RoPE width) takes
        head_dim = hf.get("head_dim") or hidden // heads
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}  # rope_scaling: transformers 4's name
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"rope_type {rope_type!r} is not supported (as in transformers, only 'default')")
        partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.5))
        return RecurrentGemmaConfig(
            vocab_size=hf["vocab_size"],
            hidden_size=hidden,
            n_layers=hf["num_hidden_layers"],
            mlp_width=hf["intermediate_size"] // 2,
            n_heads=heads,
            n_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            lru_width=hf.get("lru_width") or hidden,
            conv_width=hf.get("conv1d_width", 4),
            # sliding_window: the config's attribute_map alias of attention_window_size, set after it (it wins)
            window=hf.get("sliding_window", hf.get("attention_window_size", 2048)),
            block_types=list(hf.get("block_types", ["recurrent", "recurrent", "attention"])),
            rope_theta=rope.get("rope_theta", hf.get("rope_theta", 10000.0)),
            rotary_dim=int(head_dim * partial),
            logits_soft_cap=hf.get("logits_soft_cap", 30.0),
            norm_eps=hf.get("rms_norm_eps", 1e-6),
            attention_bias=config_bool(hf.get("attention_bias", False), "attention_bias"),
            tie_embeddings=config_bool(hf.get("tie_word_embeddings", True), "tie_word_embeddings"),
        )

    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """Griffin's initialisation: squared decay uniform in [0.9^2, 0.999^2], unit-variance gates."""
        super().init_weights(generator)
        c = self.config
        for layer in self.model.layers:
            block = layer.temporal_block
            if isinstance(block, RecurrentBlock):
                lru = block.rg_lru
                a_sq = torch.empty(c.lru_width).uniform_(0.9**2, 0.999**2, generator=generator)
                lru.recurrent_param.data.copy_(torch.log(torch.expm1(-0.5 * torch.log(a_sq))))
                for w in (lru.input_gate_weight, lru.recurrent_gate_weight):
                    nn.init.normal_(w, std=(c.lru_width // c.n_heads) ** -0.5, generator=generator)
                nn.init.zeros_(lru.input_gate_bias)
                nn.init.zeros_(lru.recurrent_gate_bias)
                nn.init.normal_(block.conv_1d.weight, std=c.conv_width**-0.5, generator=generator)
                nn.init.zeros_(block.conv_1d.bias)
        nn.init.normal_(self.model.embed_tokens.weight, std=c.hidden_size**-0.5, generator=generator)

    def state_spec(self) -> list[StateSpec]:
        c = self.config
        specs: list[StateSpec] = []
        if self._num["recurrent"]:
            n = self._num["recurrent"]
            specs += [
                StateSpec("conv", (n, c.lru_width, c.conv_width - 1), torch.float32, 0.0),
                StateSpec("rglru", (n, c.lru_width), torch.float32, 0.0),
            ]
        if self._num["attention"]:
            attention = SlidingWindowAttention(c.n_heads, c.n_kv_heads, c.head_dim, c.window)
            specs += attention.state_specs(self._num["attention"])
        return specs

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        cap = self.config.logits_soft_cap
        return soft_cap(linear(self.lm_head, self.model.final_norm(h), widened=True), cap)

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
        """RoPE ``cos, sin`` at ``positions``, shared by every attention layer (None without attention)."""
        c = self.config
        return rope_cos_sin(positions, c.rotary_dim, c.rope_theta, dtype) if self._num["attention"] else None

    def prefill(self, batch: PrefillBatch, state: StateTensors) -> torch.Tensor:
        slot_ids = batch.slot_ids
        h = self.model.embed_tokens(batch.input_ids) * self.embed_scale
        first = batch.positions == 0
        rope = self._rope(batch.positions, h.dtype)
        for layer, index in zip(self.model.layers, self._state_index, strict=True):
            x = layer.temporal_pre_norm(h)
            if layer.kind == "recurrent":
                pools = state["conv"][:, index], state["rglru"][:, index]
                out, *rows = layer.temporal_block.prefill(x, batch.cu_seqlens, first, *gather_slots(pools, slot_ids))
            else:
                pools = state["k"][:, index], state["v"][:, index]
                rows = gather_slots(pools, slot_ids)  # the ring buffers, updated in place
                out = layer.temporal_block.prefill(x, batch, rope, *rows)
            scatter_slots(pools, slot_ids, rows)
            h = layer.channel_mix(h + out)
        return self._logits(h[batch.logit_rows])

    def decode(self, batch: DecodeBatch, state: StateTensors) -> torch.Tensor:
        h = self.model.embed_tokens(batch.input_ids) * self.embed_scale
        first = batch.positions == 0
        rope = self._rope(batch.positions, h.dtype)
        for layer, index in zip(self.model.layers, self._state_index, strict=True):
            x = layer.temporal_pre_norm(h)
            block = layer.temporal_block
            if layer.kind == "recurrent":
                out = block.decode(x, batch.slot_ids, first, state["conv"][:, index], state["rglru"][:, index])
            else:
                out = block.decode(x, batch, rope, state["k"][:, index], state["v"][:, index])
            h = layer.channel_mix(h + out)
        return self._logits(h)


# The ~100M scale of De et al. 2024 (appendix C): width 768, depth 12, RG-LRU width 1024, MLP expansion 3,
# MQA with head_dim 128 and a 1024-token window. The paper's 6 attention heads do not divide the RG-LRU
# width, whose block-diagonal gates have one block per head here; 8 heads of 128 keep the paper's head_dim and
# per-token K/V (one KV head) and give gate blocks of 128. State per slot: Hawk 192 KiB, Griffin 4.1 MiB.
_GRIFFIN_100M = {
    "hidden_size": 768,
    "n_layers": 12,
    "mlp_width": 3 * 768,
    "n_heads": 8,
    "n_kv_heads": 1,
    "head_dim": 128,
    "lru_width": 1024,
    "window": 1024,
    "rotary_dim": 64,
}
register_preset(
    "hawk-tiny",
    "recurrent_gemma",
    vocab_size=320,
    hidden_size=64,
    n_layers=2,
    mlp_width=192,
    n_heads=2,
    head_dim=32,
    lru_width=64,
    rotary_dim=16,
    block_types=["recurrent"],
)
register_preset(
    "griffin-tiny",
    "recurrent_gemma",
    vocab_size=320,
    hidden_size=64,
    n_layers=3,
    mlp_width=192,
    n_heads=2,
    head_dim=32,
    lru_width=64,
    rotary_dim=16,
    window=64,
)
register_preset("hawk-100m", "recurrent_gemma", **_GRIFFIN_100M, block_types=["recurrent"])
register_preset("griffin-100m", "recurrent_gemma", **_GRIFFIN_100M)
register_preset("recurrentgemma-2b", "recurrent_gemma", n_layers=26)
