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

State per slot (constant size): the token count ``pos``, per recurrent layer the conv tail and the RG-LRU
state (fp32), per attention layer a ring buffer of the last ``window`` keys and values (position ``p`` at
row ``p % window``, RoPE already applied).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from rnnserve.engine.models.base import (
    ModelConfig,
    RecurrentLM,
    StateSpec,
    StateTensors,
    register_model,
    register_preset,
)
from rnnserve.kernels.causal_conv1d import causal_conv1d_update, causal_conv1d_varlen
from rnnserve.kernels.diag_linear_scan import diag_linear_scan, diag_scan_step


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


class GemmaRMSNorm(nn.Module):
    """RMSNorm in fp32 with a ``(1 + weight)`` scale."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        out = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight.float())
        return out.to(x.dtype)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


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

    def _gate(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        heads, width, _ = weight.shape
        blocks = x.reshape(-1, heads, width).transpose(0, 1)
        return torch.sigmoid(torch.baddbmm(bias[:, None, :], blocks, weight).transpose(0, 1).reshape(x.shape))

    def coefficients(self, x: torch.Tensor, first: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [N, D]``, ``first [N]`` (token starts its sequence) -> recurrence ``a, b`` in fp32."""
        input_gate = self._gate(x, self.input_gate_weight, self.input_gate_bias)
        recurrent_gate = self._gate(x, self.recurrent_gate_weight, self.recurrent_gate_bias)
        log_a = -8.0 * recurrent_gate * F.softplus(self.recurrent_param)
        multiplier = torch.where(first[:, None], 1.0, torch.sqrt(1 - torch.exp(2 * log_a)))
        b = (x * input_gate) * multiplier.to(x.dtype)
        a = torch.where(first[:, None], 0.0, torch.exp(log_a))
        return a.float(), b.float()


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
        y = gelu_tanh(self.linear_y(x))
        u, conv_state = causal_conv1d_varlen(
            self.linear_x(x), self.conv_1d.weight[:, 0], self.conv_1d.bias, cu_seqlens, conv_state
        )
        a, b = self.rg_lru.coefficients(u, first)
        h, lru_state = diag_linear_scan(a, b, cu_seqlens, lru_state)
        return self.linear_out(h.to(x.dtype) * y), conv_state, lru_state

    def decode(
        self,
        x: torch.Tensor,
        slot_ids: torch.Tensor,
        first: torch.Tensor,
        conv_pool: torch.Tensor,
        lru_pool: torch.Tensor,
    ) -> torch.Tensor:
        y = gelu_tanh(self.linear_y(x))
        u = causal_conv1d_update(
            self.linear_x(x), conv_pool, self.conv_1d.weight[:, 0], self.conv_1d.bias, slot_ids
        )
        a, b = self.rg_lru.coefficients(u, first)
        h = diag_scan_step(a, b, lru_pool, slot_ids)
        return self.linear_out(h.to(x.dtype) * y)


def rotate(x: torch.Tensor, positions: torch.Tensor, rotary_dim: int, theta: float) -> torch.Tensor:
    """RoPE on the first ``rotary_dim`` channels of ``x [N, heads, head_dim]`` at ``positions [N]``."""
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=x.device) / rotary_dim)
    )
    freqs = positions.float()[:, None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)[:, None, :]
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    return torch.cat([rot * cos + rotated * sin, rest], dim=-1)


class LocalAttention(nn.Module):
    def __init__(self, config: RecurrentGemmaConfig) -> None:
        super().__init__()
        c = config
        self.config = c
        self.q_proj = nn.Linear(c.hidden_size, c.n_heads * c.head_dim, bias=c.attention_bias)
        self.k_proj = nn.Linear(c.hidden_size, c.n_kv_heads * c.head_dim, bias=c.attention_bias)
        self.v_proj = nn.Linear(c.hidden_size, c.n_kv_heads * c.head_dim, bias=c.attention_bias)
        self.o_proj = nn.Linear(c.n_heads * c.head_dim, c.hidden_size, bias=True)

    def _qkv(
        self, x: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        c = self.config
        q = self.q_proj(x).view(-1, c.n_heads, c.head_dim)
        k = self.k_proj(x).view(-1, c.n_kv_heads, c.head_dim)
        v = self.v_proj(x).view(-1, c.n_kv_heads, c.head_dim)
        return (
            rotate(q, positions, c.rotary_dim, c.rope_theta),
            rotate(k, positions, c.rotary_dim, c.rope_theta),
            v,
        )

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``q [B, Lq, H, d]``, ``k, v [B, Lk, Hkv, d]``, ``mask [B, Lq, Lk]`` -> ``[B, Lq, H * d]``."""
        c = self.config
        group = c.n_heads // c.n_kv_heads
        q, k, v = (t.transpose(1, 2).float() for t in (q, k, v))
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = (q @ k.transpose(2, 3)) * c.head_dim**-0.5
        scores = scores.masked_fill(~mask[:, None], float("-inf"))
        out = torch.softmax(scores, dim=-1) @ v
        return out.transpose(1, 2).reshape(q.shape[0], -1, c.n_heads * c.head_dim)

    def prefill(
        self,
        x: torch.Tensor,
        cu_seqlens: torch.Tensor,
        start_pos: list[int],
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        """``k_cache, v_cache [B, W, Hkv, d]`` hold each sequence's ring buffer; updated in place."""
        window = self.config.window
        bounds = cu_seqlens.tolist()
        lengths = [bounds[i + 1] - bounds[i] for i in range(len(start_pos))]
        positions = torch.cat(
            [torch.arange(p, p + n, device=x.device) for p, n in zip(start_pos, lengths, strict=True)]
        )
        q, k, v = self._qkv(x, positions)
        out = torch.empty(
            x.shape[0], self.config.n_heads * self.config.head_dim, dtype=torch.float32, device=x.device
        )
        rows = torch.arange(window, device=x.device)
        for i, (p0, n) in enumerate(zip(start_pos, lengths, strict=True)):
            lo, hi = bounds[i], bounds[i + 1]
            # Ring row r holds the latest position < p0 congruent to r (mod W), if any.
            cached_pos = p0 - 1 - (p0 - 1 - rows) % window
            keys_pos = torch.cat([cached_pos, positions[lo:hi]])
            keys = torch.cat([k_cache[i].to(k.dtype), k[lo:hi]])
            values = torch.cat([v_cache[i].to(v.dtype), v[lo:hi]])
            q_pos = positions[lo:hi, None]
            mask = (keys_pos[None] >= 0) & (keys_pos[None] <= q_pos) & (keys_pos[None] > q_pos - window)
            out[lo:hi] = self._attend(q[None, lo:hi], keys[None], values[None], mask[None])[0]
            keep = min(n, window)
            ring_rows = positions[hi - keep : hi] % window
            k_cache[i, ring_rows] = k[hi - keep : hi].to(k_cache.dtype)
            v_cache[i, ring_rows] = v[hi - keep : hi].to(v_cache.dtype)
        return self.o_proj(out.to(x.dtype))

    def decode(
        self,
        x: torch.Tensor,
        slot_ids: torch.Tensor,
        pos: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
    ) -> torch.Tensor:
        window = self.config.window
        q, k, v = self._qkv(x, pos)
        ring_rows = pos % window
        k_pool[slot_ids, ring_rows] = k.to(k_pool.dtype)
        v_pool[slot_ids, ring_rows] = v.to(v_pool.dtype)
        mask = (torch.arange(window, device=x.device)[None, :] <= pos[:, None])[:, None, :]
        out = self._attend(q[:, None], k_pool[slot_ids], v_pool[slot_ids], mask)[:, 0]
        return self.o_proj(out.to(x.dtype))


class MLP(nn.Module):
    def __init__(self, config: RecurrentGemmaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.mlp_width)
        self.up_proj = nn.Linear(config.hidden_size, config.mlp_width)
        self.down_proj = nn.Linear(config.mlp_width, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gelu_tanh(self.gate_proj(x)) * self.up_proj(x))


class ResidualBlock(nn.Module):
    def __init__(self, config: RecurrentGemmaConfig, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.temporal_pre_norm = GemmaRMSNorm(config.hidden_size, config.norm_eps)
        self.temporal_block = RecurrentBlock(config) if kind == "recurrent" else LocalAttention(config)
        self.channel_pre_norm = GemmaRMSNorm(config.hidden_size, config.norm_eps)
        self.mlp_block = MLP(config)

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
        head_dim = hf.get("head_dim") or hidden // heads
        rope = hf.get("rope_parameters") or {}
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"rope_type {rope['rope_type']!r} is not supported")
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
            window=hf.get("attention_window_size", 2048),
            block_types=list(hf.get("block_types", ["recurrent", "recurrent", "attention"])),
            rope_theta=rope.get("rope_theta", hf.get("rope_theta", 10000.0)),
            rotary_dim=int(head_dim * partial),
            logits_soft_cap=hf.get("logits_soft_cap", 30.0),
            norm_eps=hf.get("rms_norm_eps", 1e-6),
            attention_bias=hf.get("attention_bias", False),
            tie_embeddings=hf.get("tie_word_embeddings", True),
        )

    @staticmethod
    def hf_weight_name(name: str) -> str:
        return name

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
        specs = [StateSpec("pos", (1,), torch.int64, 0)]
        if self._num["recurrent"]:
            n = self._num["recurrent"]
            specs += [
                StateSpec("conv", (n, c.lru_width, c.conv_width - 1), torch.float32, 0.0),
                StateSpec("rglru", (n, c.lru_width), torch.float32, 0.0),
            ]
        if self._num["attention"]:
            shape = (self._num["attention"], c.window, c.n_kv_heads, c.head_dim)
            specs += [StateSpec("k", shape, torch.float32, 0.0), StateSpec("v", shape, torch.float32, 0.0)]
        return specs

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        cap = self.config.logits_soft_cap
        logits = self.lm_head(self.model.final_norm(h)).float()
        return torch.tanh(logits / cap) * cap

    def prefill(
        self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor, slot_ids: torch.Tensor, state: StateTensors
    ) -> torch.Tensor:
        start = state["pos"][slot_ids, 0]
        lengths = cu_seqlens[1:] - cu_seqlens[:-1]
        seq = torch.repeat_interleave(torch.arange(lengths.numel(), device=input_ids.device), lengths)
        positions = (
            start[seq] + torch.arange(input_ids.numel(), device=input_ids.device) - cu_seqlens[:-1][seq]
        )
        first = positions == 0
        start_pos = start.tolist()
        h = self.model.embed_tokens(input_ids) * self.embed_scale
        for layer, index in zip(self.model.layers, self._state_index, strict=True):
            x = layer.temporal_pre_norm(h)
            block = layer.temporal_block
            if layer.kind == "recurrent":
                conv_pool, lru_pool = state["conv"][:, index], state["rglru"][:, index]
                out, conv, lru = block.prefill(x, cu_seqlens, first, conv_pool[slot_ids], lru_pool[slot_ids])
                conv_pool[slot_ids] = conv.to(conv_pool.dtype)
                lru_pool[slot_ids] = lru
            else:
                k_pool, v_pool = state["k"][:, index], state["v"][:, index]
                k_cache, v_cache = k_pool[slot_ids], v_pool[slot_ids]
                out = block.prefill(x, cu_seqlens, start_pos, k_cache, v_cache)
                k_pool[slot_ids], v_pool[slot_ids] = k_cache, v_cache
            h = layer.channel_mix(h + out)
        state["pos"][slot_ids, 0] = start + lengths
        return self._logits(h[cu_seqlens[1:] - 1])

    def decode(self, input_ids: torch.Tensor, slot_ids: torch.Tensor, state: StateTensors) -> torch.Tensor:
        pos = state["pos"][slot_ids, 0]
        first = pos == 0
        h = self.model.embed_tokens(input_ids) * self.embed_scale
        for layer, index in zip(self.model.layers, self._state_index, strict=True):
            x = layer.temporal_pre_norm(h)
            block = layer.temporal_block
            if layer.kind == "recurrent":
                out = block.decode(x, slot_ids, first, state["conv"][:, index], state["rglru"][:, index])
            else:
                out = block.decode(x, slot_ids, pos, state["k"][:, index], state["v"][:, index])
            h = layer.channel_mix(h + out)
        state["pos"][slot_ids, 0] = pos + 1
        return self._logits(h)


_GRIFFIN_100M = {
    "hidden_size": 768,
    "n_layers": 12,
    "mlp_width": 3 * 768,
    "n_heads": 6,
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
