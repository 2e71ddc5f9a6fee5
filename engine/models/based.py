"""Based (Arora et al. 2024): BaseConv gated short convolutions, Taylor linear attention and sliding-window
attention, in the layout of the authors' released checkpoints (HazyResearch/based ``GPTLMHeadModel``).

Each layer is pre-norm residual::

    h = h + mixer(RMSNorm(h))          # mixer chosen per layer: BaseConv, LinearAttention or SlidingAttention
    h = h + fc2(y * silu(gate))        # y, gate = fc1(RMSNorm(h)).chunk(2)

then ``ln_f`` and the tied LM head over the padded vocabulary.

- BaseConv: ``u1, u2 = in_proj(x).split(d_inner)``; ``out_proj(silu(causal_conv(u1)) * u2)``, depthwise conv of
  width 3 without bias.
- LinearAttention: ``q, k = proj_q(x), proj_k(x)`` in heads of ``feature_dim``, ``v = proj_v(x)``; Taylor features
  ``phi(q) . phi(k) = 1 + s + s^2/2``, ``s = q . k / sqrt(input_dim)``; causal normalised read-out; ``out_proj``.
- SlidingAttention: ``Wqkv`` (q, k, v blocks, heads contiguous), RoPE (half-split) on q and k, softmax
  attention over the current token and the ``window_size // 2`` before it, ``out_proj``.

State per slot (constant size): per BaseConv layer the conv tail ``[d_inner, 2]``; per LinearAttention layer
``S [heads, 1 + f + f^2, head_dim]`` and ``z [heads, 1 + f + f^2]``; per SlidingAttention layer a ring of the last
``window_size // 2`` post-RoPE keys and values. All fp32.

Checkpoints load from the authors' GPT-2-style ``config.json`` (``model_type: "gpt2"`` with ``mixer`` /
``alt_mixer`` / ``alt_mixer_2`` dicts) or from a native ``architecture: "based"`` config; parameter names are the
authors' in both.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

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
    config_bool,
    register_model,
    register_preset,
)
from rnnserve.engine.models.layers import (
    RMSNorm,
    SlidingWindowAttention,
    apply_rope,
    gather_slots,
    linear,
    rope_cos_sin,
    scatter_slots,
)
from rnnserve.engine.models.layers.slots import slot_index
from rnnserve.kernels.based import based_linear_attention_step, based_linear_attention_varlen
from rnnserve.kernels.causal_conv1d import causal_conv1d_update, causal_conv1d_varlen
from rnnserve.kernels.residual_rms_norm import residual_rms_norm

MIXER_KINDS = ("conv", "linear_attention", "sliding_window")
_MIXER_CLASSES = {"BaseConv": "conv", "LinearAttention": "linear_attention", "SlidingAttention": "sliding_window"}


@dataclass
class BasedConfig(ModelConfig):
    """Based hyperparameters; ``vocab_size`` is the padded vocabulary (embedding rows and logits)."""

    vocab_size: int = 50264
    d_model: int = 1024
    n_layers: int = 27
    mlp_hidden: int = 2048
    linear_attention_layers: list[int] = field(default_factory=lambda: [1, 6, 11, 16, 21])
    sliding_window_layers: list[int] = field(default_factory=lambda: [2, 7, 12, 17, 22])
    conv_expand: int = 4
    conv_kernel: int = 3
    conv_bias: bool = True
    la_heads: int = 16
    la_feature_dim: int = 16
    la_head_dim: int = 64
    taylor_input_dim: int = 16
    la_eps: float = 1e-6
    sw_heads: int = 16
    window_size: int = 256
    rotary_dim: int = 64
    rope_theta: float = 10000.0
    sw_qkv_bias: bool = False
    sw_out_bias: bool = False
    norm_eps: float = 1e-5
    residual_in_fp32: bool = True
    fixed_decay: bool = False
    decay_const: float = -3.0
    tie_embeddings: bool = True

    def layer_kinds(self) -> list[str]:
        """Each layer's mixer (sliding window first, as the authors' ``create_mixer_cls`` checks it first)."""
        sliding, linear_attention = set(self.sliding_window_layers), set(self.linear_attention_layers)
        return [
            "sliding_window" if i in sliding else "linear_attention" if i in linear_attention else "conv"
            for i in range(self.n_layers)
        ]

    @property
    def ring_size(self) -> int:
        """Keys kept per sliding-window layer: a query sees these and itself."""
        return self.window_size // 2

    @property
    def sw_head_dim(self) -> int:
        return self.d_model // self.sw_heads


class ShortConvolution(nn.Module):
    """Holds the depthwise conv weight under the authors' name ``conv.conv.weight [C, 1, K]``."""

    def __init__(self, channels: int, kernel: int) -> None:
        super().__init__()
        self.conv = nn.Conv1d(channels, channels, kernel, groups=channels, padding=kernel - 1, bias=False)


class BaseConv(nn.Module):
    def __init__(self, c: BasedConfig) -> None:
        super().__init__()
        self.d_inner = c.conv_expand * c.d_model // 2
        self.in_proj = nn.Linear(c.d_model, c.conv_expand * c.d_model, bias=c.conv_bias)
        self.out_proj = nn.Linear(self.d_inner, c.d_model, bias=c.conv_bias)
        self.conv = ShortConvolution(self.d_inner, c.conv_kernel)

    def prefill(
        self, x: torch.Tensor, cu_seqlens: torch.Tensor, conv_state: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        u1, u2 = linear(self.in_proj, x).split(self.d_inner, dim=-1)
        y, conv_state = causal_conv1d_varlen(u1, self.conv.conv.weight[:, 0], None, cu_seqlens, conv_state, silu=True)
        return linear(self.out_proj, y * u2), conv_state

    def decode(self, x: torch.Tensor, slot_ids: torch.Tensor, conv_pool: torch.Tensor) -> torch.Tensor:
        u1, u2 = linear(self.in_proj, x).split(self.d_inner, dim=-1)
        y = causal_conv1d_update(u1, conv_pool, self.conv.conv.weight[:, 0], None, slot_ids, silu=True)
        return linear(self.out_proj, y * u2)


class LinearAttention(nn.Module):
    def __init__(self, c: BasedConfig) -> None:
        super().__init__()
        self.heads, self.feature_dim, self.head_dim = c.la_heads, c.la_feature_dim, c.la_head_dim
        self.scale, self.eps = c.taylor_input_dim**-0.5, c.la_eps
        self.proj_q = nn.Linear(c.d_model, c.la_feature_dim * c.la_heads, bias=False)
        self.proj_k = nn.Linear(c.d_model, c.la_feature_dim * c.la_heads, bias=False)
        self.proj_v = nn.Linear(c.d_model, c.la_heads * c.la_head_dim, bias=False)
        self.out_proj = nn.Linear(c.la_heads * c.la_head_dim, c.d_model, bias=False)

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q = linear(self.proj_q, x).reshape(-1, self.heads, self.feature_dim)
        k = linear(self.proj_k, x).reshape(-1, self.heads, self.feature_dim)
        return q, k, linear(self.proj_v, x).reshape(-1, self.heads, self.head_dim)

    def prefill(
        self, x: torch.Tensor, cu_seqlens: torch.Tensor, s_state: torch.Tensor, z_state: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        out, s_state, z_state = based_linear_attention_varlen(
            *self._qkv(x), cu_seqlens, (s_state, z_state), self.scale, self.eps
        )
        return linear(self.out_proj, out.flatten(1).to(x.dtype)), s_state, z_state

    def decode(
        self,
        x: torch.Tensor,
        slot_ids: torch.Tensor,
        slots: torch.Tensor | slice,
        s_pool: torch.Tensor,
        z_pool: torch.Tensor,
    ) -> torch.Tensor:
        out = based_linear_attention_step(*self._qkv(x), s_pool, z_pool, slot_ids, slots, self.scale, self.eps)
        return linear(self.out_proj, out.flatten(1).to(x.dtype))


class SlidingAttention(nn.Module):
    """The authors' sliding-window attention: the shared ring-buffer layer with a window of the current token
    and the ``window_size // 2`` before it."""

    def __init__(self, c: BasedConfig) -> None:
        super().__init__()
        self.attention = SlidingWindowAttention(c.sw_heads, c.sw_heads, c.sw_head_dim, c.ring_size + 1)
        self.Wqkv = nn.Linear(c.d_model, 3 * c.d_model, bias=c.sw_qkv_bias)
        self.out_proj = nn.Linear(c.d_model, c.d_model, bias=c.sw_out_bias)

    def _qkv(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        a = self.attention
        q, k, v = linear(self.Wqkv, x).reshape(-1, 3, a.n_heads, a.head_dim).unbind(1)
        return apply_rope(q, *rope), apply_rope(k, *rope), v

    def prefill(
        self,
        x: torch.Tensor,
        batch: PrefillBatch,
        rope: tuple[torch.Tensor, torch.Tensor],
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        """``k_cache, v_cache [B, W, heads, head_dim]``: the sequences' rings, updated in place."""
        out = self.attention.prefill(*self._qkv(x, rope), batch, k_cache, v_cache)
        return linear(self.out_proj, out.to(x.dtype))

    def decode(
        self,
        x: torch.Tensor,
        batch: DecodeBatch,
        rope: tuple[torch.Tensor, torch.Tensor],
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
    ) -> torch.Tensor:
        out = self.attention.decode(*self._qkv(x, rope), batch.positions, batch.slot_ids, k_pool, v_pool)
        return linear(self.out_proj, out.to(x.dtype))


class SwiGLU(nn.Module):
    """The authors' ``GatedMlp``: ``fc2(y * silu(gate))`` with ``y, gate = fc1(x).chunk(2)``."""

    def __init__(self, c: BasedConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(c.d_model, 2 * c.mlp_hidden, bias=False)
        self.fc2 = nn.Linear(c.mlp_hidden, c.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, gate = linear(self.fc1, x).chunk(2, dim=-1)
        return linear(self.fc2, y * F.silu(gate))


_MIXERS: dict[str, type[nn.Module]] = {
    "conv": BaseConv,
    "linear_attention": LinearAttention,
    "sliding_window": SlidingAttention,
}


class Block(nn.Module):
    def __init__(self, c: BasedConfig, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.norm1 = RMSNorm(c.d_model, c.norm_eps)
        self.mixer = _MIXERS[kind](c)
        self.norm2 = RMSNorm(c.d_model, c.norm_eps)
        self.mlp = SwiGLU(c)


class Embeddings(nn.Module):
    def __init__(self, c: BasedConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(c.vocab_size, c.d_model)


class Decay(nn.Module):
    """based-1b's ``transformer.decay.decay`` buffer: stored in the checkpoint, read by no mixer."""

    def __init__(self, c: BasedConfig) -> None:
        super().__init__()
        self.register_buffer("decay", torch.log(1 - 2.0 ** (c.decay_const - torch.arange(c.sw_heads).float())))


class Transformer(nn.Module):
    def __init__(self, c: BasedConfig) -> None:
        super().__init__()
        self.embeddings = Embeddings(c)
        self.layers = nn.ModuleList(Block(c, kind) for kind in c.layer_kinds())
        self.ln_f = RMSNorm(c.d_model, c.norm_eps)
        if c.fixed_decay:
            self.decay = Decay(c)


_BASED_FLAGS = {  # the boolean GPT-2 config keys the mapping reads before the config checks its own, with defaults
    "rms_norm": False,
    "rotary_emb_interleaved": False,
    "scale_attn_by_inverse_layer_idx": False,
    "scale_attn_weights": True,
    "mlp_fc1_bias": True,
    "mlp_fc2_bias": True,
    "prenorm": True,
    "parallel_block": False,
}


def _mlp_hidden(hf: Mapping[str, Any], d_model: int) -> int:
    """``n_inner`` (default ``8 d / 3``) rounded up to a multiple of 256, as the authors' ``GatedMlp``."""
    hidden = hf.get("n_inner") or int(8 * d_model / 3)
    return (hidden + 255) // 256 * 256


def _mixer_kind(spec: Any, slot: str) -> str:
    target = spec.get("_target_", "") if isinstance(spec, Mapping) else ""
    kind = _MIXER_CLASSES.get(target.rsplit(".", 1)[-1])
    if kind is None:
        known = "BaseConv, LinearAttention, SlidingAttention"
        raise ValueError(f"{slot} {target or spec!r} is not a Based mixer ({known})")
    return kind


@register_model
class BasedLM(RecurrentLM):
    """Based in the authors' ``GPTLMHeadModel`` layout (``transformer.*``, ``lm_head``)."""

    architecture = "based"
    config_class = BasedConfig
    hf_model_types = ("gpt2",)

    def __init__(self, config: BasedConfig) -> None:
        super().__init__(config)
        if config.window_size < 2:
            raise ValueError(f"window_size {config.window_size} keeps no keys (needs >= 2)")
        if config.d_model % config.sw_heads:
            raise ValueError(f"d_model {config.d_model} is not a multiple of sw_heads {config.sw_heads}")
        self.transformer = Transformer(config)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.transformer.embeddings.word_embeddings.weight
        kinds = config.layer_kinds()
        self._state_index = [kinds[:i].count(kind) for i, kind in enumerate(kinds)]
        self._num = {kind: kinds.count(kind) for kind in MIXER_KINDS}

    @classmethod
    def from_hf_config(cls, hf: Mapping[str, Any]) -> BasedConfig:
        """Map the authors' GPT-2-style config.json (a ``GPT2Config`` dict with Based's mixer dicts)."""
        if not isinstance(hf.get("mixer"), Mapping):
            raise ValueError(
                "a GPT-2 config without Based's 'mixer' dict: rnnserve reads model_type 'gpt2' only as Based "
                "(plain GPT-2 is not a recurrent model)"
            )
        d_model = hf.get("hidden_size", hf.get("n_embd", 768))
        n_layers = hf.get("num_hidden_layers", hf.get("n_layer", 12))
        n_head = hf.get("num_attention_heads", hf.get("n_head", 12))
        flag = {name: config_bool(hf.get(name, default), name) for name, default in _BASED_FLAGS.items()}
        unsupported = {
            "rms_norm": (flag["rms_norm"], True),
            "activation_function": (hf.get("activation_function", "gelu_new"), "swiglu"),
            "mlp_type": (hf.get("mlp_type") or "base", "base"),
            "rotary_emb_interleaved": (flag["rotary_emb_interleaved"], False),
            "rotary_emb_scale_base": (hf.get("rotary_emb_scale_base"), None),  # xPos scaling of q and k
            "scale_attn_by_inverse_layer_idx": (flag["scale_attn_by_inverse_layer_idx"], False),
            "scale_attn_weights": (flag["scale_attn_weights"], True),
            "max_position_embeddings": (hf.get("max_position_embeddings", hf.get("n_positions", 1024)), 0),
            "prenorm": (flag["prenorm"], True),  # false: post-norm blocks and no final norm
            "parallel_block": (flag["parallel_block"], False),  # true: GPT-J-style parallel mixer and MLP
            "word_embed_proj_dim": (hf.get("word_embed_proj_dim"), None),  # OPT-350m's embedding projections
        }
        for key, (value, wanted) in unsupported.items():
            if value != wanted:
                raise ValueError(f"{key}={value!r} is not supported (Based checkpoints use {wanted!r})")
        if hf.get("head_dim") not in (None, d_model // n_head):  # the window's softmax scale and RoPE width read it
            raise ValueError(f"head_dim {hf['head_dim']} other than n_embd / n_head ({d_model // n_head}) is refused")
        if hf.get("n_head_kv") not in (None, n_head):
            raise ValueError("n_head_kv != n_head is not supported")
        if flag["mlp_fc1_bias"] or flag["mlp_fc2_bias"]:
            raise ValueError("MLP biases are not supported (Based checkpoints set mlp_fc1_bias/mlp_fc2_bias false)")
        alt, alt2 = set(hf.get("alt_mixer_layers") or ()), set(hf.get("alt_mixer_2_layers") or ())
        specs = [
            ("alt_mixer_2", hf.get("alt_mixer_2")) if i in alt2 else ("alt_mixer", hf.get("alt_mixer")) if i in alt
            else ("mixer", hf["mixer"])
            for i in range(n_layers)
        ]
        layers: dict[str, list[int]] = {kind: [] for kind in MIXER_KINDS}
        by_kind: dict[str, Mapping[str, Any]] = {}
        for i, (slot, spec) in enumerate(specs):
            kind = _mixer_kind(spec, slot)
            if kind in by_kind and by_kind[kind] != spec:
                raise ValueError(f"layers use two different {kind} configurations")
            by_kind[kind] = spec
            layers[kind].append(i)
        conv = by_kind.get("conv", {})
        la = by_kind.get("linear_attention", {})
        sw = by_kind.get("sliding_window", {})
        la_heads = la.get("num_heads", 16)
        feature_map = la.get("feature_map") or {}
        if la and feature_map.get("_target_", "TaylorExp").rsplit(".", 1)[-1] != "TaylorExp":
            raise ValueError(f"feature map {feature_map.get('_target_')!r} is not supported (Based uses TaylorExp)")
        fla = str(la.get("parallel_implementation", "quadratic")).startswith("fla")
        window_size = sw.get("window_size", 128)  # SlidingAttention's default
        if sw and window_size is None:  # only a layer that builds the mixer reads it
            raise ValueError(
                f"alt_mixer_2.window_size is null for the sliding-window layers {layers['sliding_window']}: the "
                "authors' SlidingAttention refuses a null window (it asserts), so no such model was trained; give "
                "the window in tokens (the released models use 256)"
            )
        head_dim = d_model // n_head
        vocab, multiple = hf.get("vocab_size", 50257), hf.get("pad_vocab_size_multiple", 1)
        return BasedConfig(
            vocab_size=math.ceil(vocab / multiple) * multiple,
            d_model=d_model,
            n_layers=n_layers,
            mlp_hidden=_mlp_hidden(hf, d_model),
            linear_attention_layers=layers["linear_attention"],
            sliding_window_layers=layers["sliding_window"],
            conv_expand=conv.get("expand_proj", 2),
            conv_kernel=conv.get("kernel_size", 3),
            conv_bias=config_bool(conv.get("use_bias", True), "mixer.use_bias"),
            la_heads=la_heads,
            la_feature_dim=la.get("feature_dim", 16),
            la_head_dim=la.get("head_dim") or d_model // la_heads,
            taylor_input_dim=feature_map.get("input_dim", la.get("feature_dim", 16)),
            la_eps=la.get("eps", 1e-6 if fla else 1e-12),
            sw_heads=n_head,
            window_size=window_size,
            rotary_dim=int(hf.get("rotary_emb_fraction", 0.0) * head_dim),
            rope_theta=hf.get("rotary_emb_base", 10000.0),
            sw_qkv_bias=config_bool(hf.get("qkv_proj_bias", True), "qkv_proj_bias"),
            sw_out_bias=config_bool(hf.get("out_proj_bias", True), "out_proj_bias"),
            norm_eps=hf.get("layer_norm_epsilon", 1e-5),
            residual_in_fp32=config_bool(hf.get("residual_in_fp32", False), "residual_in_fp32"),
            fixed_decay=config_bool(hf.get("fixed_decay", False), "fixed_decay"),
            decay_const=hf.get("decay_const", -3),
            tie_embeddings=config_bool(hf.get("tie_word_embeddings", True), "tie_word_embeddings"),
        )

    @staticmethod
    def hf_weight_name(name: str) -> str:
        """The authors' loader strips a leading ``model.``; names are otherwise the parameters' own."""
        return name.removeprefix("model.")

    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """Random weights; embeddings at the authors' ``initializer_range`` 0.02."""
        super().init_weights(generator)
        nn.init.normal_(self.transformer.embeddings.word_embeddings.weight, std=0.02, generator=generator)
        for block in self.transformer.layers:
            if block.kind == "conv":
                nn.init.normal_(block.mixer.conv.conv.weight, std=self.config.conv_kernel**-0.5, generator=generator)

    def state_spec(self) -> list[StateSpec]:
        c = self.config
        features = 1 + c.la_feature_dim + c.la_feature_dim**2
        d_inner = c.conv_expand * c.d_model // 2
        specs: list[StateSpec] = []
        if self._num["conv"]:
            specs.append(StateSpec("conv", (self._num["conv"], d_inner, c.conv_kernel - 1), torch.float32))
        if n := self._num["linear_attention"]:
            specs.append(StateSpec("kv", (n, c.la_heads, features, c.la_head_dim), torch.float32))
            specs.append(StateSpec("k_sum", (n, c.la_heads, features), torch.float32))
        if n := self._num["sliding_window"]:
            specs += SlidingWindowAttention(c.sw_heads, c.sw_heads, c.sw_head_dim, c.ring_size + 1).state_specs(n)
        return specs

    def _pools(self, state: StateTensors, kind: str, index: int) -> tuple[torch.Tensor, ...]:
        names = {"conv": ("conv",), "linear_attention": ("kv", "k_sum"), "sliding_window": ("k", "v")}[kind]
        return tuple(state[name][:, index] for name in names)

    def _stream(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.transformer.embeddings.word_embeddings(input_ids)
        return h.float() if self.config.residual_in_fp32 else h

    def _add_norm(self, stream: torch.Tensor, delta: torch.Tensor | None, norm: RMSNorm) -> tuple[torch.Tensor, ...]:
        """``stream + delta`` and its norm (the norm's input rounded to the weight dtype, as the authors' blocks)."""
        return residual_rms_norm(stream, delta, norm.weight, norm.eps)

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
        c = self.config
        return rope_cos_sin(positions, c.rotary_dim, c.rope_theta, dtype) if self._num["sliding_window"] else None

    def _logits(self, stream: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        normed, _ = self._add_norm(stream, delta, self.transformer.ln_f)
        return linear(self.lm_head, normed, widened=True).float()

    def prefill(self, batch: PrefillBatch, state: StateTensors) -> torch.Tensor:
        slot_ids = batch.slot_ids
        stream, delta = self._stream(batch.input_ids), None
        rope = self._rope(batch.positions, self.transformer.embeddings.word_embeddings.weight.dtype)
        for block, index in zip(self.transformer.layers, self._state_index, strict=True):
            normed, stream = self._add_norm(stream, delta, block.norm1)
            pools = self._pools(state, block.kind, index)
            rows = gather_slots(pools, slot_ids)
            if block.kind == "sliding_window":
                out = block.mixer.prefill(normed, batch, rope, *rows)  # the rings are updated in place
            else:
                out, *rows = block.mixer.prefill(normed, batch.cu_seqlens, *rows)
            scatter_slots(pools, slot_ids, rows)
            normed, stream = self._add_norm(stream, out, block.norm2)
            delta = block.mlp(normed)
        logit_rows = batch.logit_rows
        return self._logits(stream[logit_rows], delta[logit_rows])

    def decode(self, batch: DecodeBatch, state: StateTensors) -> torch.Tensor:
        slot_ids = batch.slot_ids
        slots = slot_index(slot_ids)
        stream, delta = self._stream(batch.input_ids), None
        rope = self._rope(batch.positions, self.transformer.embeddings.word_embeddings.weight.dtype)
        for block, index in zip(self.transformer.layers, self._state_index, strict=True):
            normed, stream = self._add_norm(stream, delta, block.norm1)
            pools = self._pools(state, block.kind, index)
            if block.kind == "conv":
                out = block.mixer.decode(normed, slot_ids, *pools)
            elif block.kind == "linear_attention":
                out = block.mixer.decode(normed, slot_ids, slots, *pools)
            else:
                out = block.mixer.decode(normed, batch, rope, *pools)
            normed, stream = self._add_norm(stream, out, block.norm2)
            delta = block.mlp(normed)
        return self._logits(stream, delta)


def _released(d_model: int, n_layers: int, mlp_hidden: int, linear_attention: list[int], sliding: list[int]) -> dict:
    """The authors' reference configs (train/configs/experiment/reference): 16 heads everywhere, Taylor feature
    dimension 16, window 256 (a query sees 129 keys), padded GPT-2 vocabulary."""
    return {
        "vocab_size": 50264,
        "d_model": d_model,
        "n_layers": n_layers,
        "mlp_hidden": mlp_hidden,
        "linear_attention_layers": linear_attention,
        "sliding_window_layers": sliding,
        "la_head_dim": d_model // 16,
        "rotary_dim": d_model // 16,
    }


register_preset("based-360m", "based", **_released(1024, 27, 2048, [1, 6, 11, 16, 21], [2, 7, 12, 17, 22]))
register_preset(
    "based-1b",
    "based",
    **_released(1792, 36, 3584, [1, 6, 11, 16, 21, 27, 33], [2, 7, 12, 17, 22, 28, 34]),
    la_eps=1e-12,
    fixed_decay=True,
)
register_preset(
    "based-tiny",
    "based",
    vocab_size=320,
    d_model=64,
    n_layers=4,
    mlp_hidden=128,
    linear_attention_layers=[1],
    sliding_window_layers=[2],
    la_heads=2,
    la_feature_dim=8,
    la_head_dim=32,
    taylor_input_dim=8,
    sw_heads=2,
    window_size=16,
    rotary_dim=32,
)
