"""Looped transformers: one weight-tied transformer block applied ``n_loop`` times per token ("On Expressive
Power of Looped Transformers", Xu & Sato 2025), as the authors' released code (``kevin671/tmlt``) computes them.

Both variants embed tokens (``embed``, tied to the LM head) plus learned absolute positions (``pos_embed``,
``block_size`` rows), run the block ``n_loop`` times, then a final RMSNorm with a weight. Attention is causal
multi-head softmax attention with separate ``q, k, v`` projections and an output projection, scale
``1/sqrt(head_dim)``; the MLP is ``fc_out(gelu(fc_in(x)))`` (4x, exact GELU). Inner RMSNorms have no weight
and PyTorch's default eps (fp32 epsilon; statistics in fp32). Per loop ``t``:

* ``lt`` (plain)::

      n = norm(x);  x = x + attn(q=n, k=n, v=x)      # the value input is the un-normalized x, as released
      x = x + mlp(x)                                  # no norm before the MLP

  With ``prenorm_block`` (the authors' earlier ``LoopedGPT``, ``model.py`` at commit 340f627, whose attention had
  one fused ``c_attn`` projection for q, k and v)::

      x = x + attn(q=n, k=n, v=n)  with n = norm(x)   # q, k and v all from the norm
      x = x + mlp(norm(x))

* ``tmlt`` (timestep-modulated): ``[gate_attn, gate_mlp, scale_attn, scale_mlp](t)`` come from a DiT-style
  embedding of ``t`` (256 sinusoidal frequencies, cos then sin, max period 10000, Linear-SiLU-Linear), then
  SiLU and one Linear; they depend only on ``t``, so :meth:`TimestepModulatedLoopedTransformer.refresh_modulation`
  precomputes the ``[n_loop, 4, d]`` table whenever weights are initialised or loaded::

      x = x + gate_attn * attn(norm(x) * (1 + scale_attn))
      x = x + gate_mlp * mlp(norm(x) * (1 + scale_mlp))

The released code does not re-add the input embedding between loops (the paper's formulation does); neither
does this module.

State per slot: the keys and values every loop wrote for every position, ``k, v [n_loop, n_head, block_size,
head_dim]`` (head-major) in the weights' dtype (cached activations, not accumulators). Positions come from the batch (no
counter in the state): a token at position ``p`` writes row ``p`` of each loop's cache and attends to rows
``0 .. p``. The learned position table bounds a sequence at ``block_size`` tokens: ``max_model_len``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
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
    register_model,
    register_preset,
)
from rnnserve.engine.models.layers import RMSNorm, linear, matmul_t, rms_normalize
from rnnserve.kernels.cached_attention import cached_attention_decode, cached_attention_prefill
from rnnserve.kernels.gated_act import gated_act

__all__ = [
    "LoopedConfig",
    "LoopedTransformer",
    "TimestepModulatedLoopedTransformer",
    "shape_problem",
    "timestep_frequencies",
]

NORM_EPS = torch.finfo(torch.float32).eps
"""``nn.RMSNorm(eps=None)`` uses the input dtype's epsilon; the norms here compute in fp32."""
TIMESTEP_FREQUENCIES = 256
TIMESTEP_MAX_PERIOD = 10000.0

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]


@dataclass
class LoopedConfig(ModelConfig):
    """The authors' ``model_args`` that shape the model (``n_layer`` and ``dropout`` play no part in serving), and
    ``prenorm_block``: the plain ``lt`` block of the authors' earlier code (values and MLP input normalised)."""

    vocab_size: int = 50304
    n_embd: int = 768
    n_head: int = 12
    n_loop: int = 24
    block_size: int = 1024
    bias: bool = False
    prenorm_block: bool = False

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


SHAPE_MINIMUMS = {"vocab_size": 1, "n_embd": 1, "n_head": 1, "n_loop": 0, "block_size": 1}


def shape_problem(values: Mapping[str, Any]) -> str | None:
    """Why the model shape in ``values`` (``LoopedConfig`` fields, or the authors' ``model_args``) cannot be built,
    naming the field; ``None`` if it can (a value that is not an int is left to the config's type check)."""
    sizes = {field: values[field] for field in SHAPE_MINIMUMS if isinstance(values[field], int)}
    for field, size in sizes.items():
        if size < SHAPE_MINIMUMS[field]:
            return f"{field} must be at least {SHAPE_MINIMUMS[field]}, got {size}"
    if {"n_embd", "n_head"} <= sizes.keys() and sizes["n_embd"] % sizes["n_head"]:
        return f"n_embd {values['n_embd']} is not a multiple of n_head {values['n_head']}"
    return None


def timestep_frequencies(t: torch.Tensor, dim: int = TIMESTEP_FREQUENCIES) -> torch.Tensor:
    """DiT's sinusoidal embedding of loop indices ``t [N]``: ``[cos(t f), sin(t f)]`` with ``dim / 2``
    frequencies ``f_i = period^(-i / (dim / 2))``, fp32 ``[N, dim]``."""
    half = dim // 2
    freqs = torch.exp(-math.log(TIMESTEP_MAX_PERIOD) * torch.arange(half, dtype=torch.float32) / half)
    args = t.float()[:, None] * freqs.to(t.device)[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class LoopedBlock(nn.Module):
    """The weight-tied block's parameters: attention projections and the MLP."""

    def __init__(self, config: LoopedConfig) -> None:
        super().__init__()
        d, bias = config.n_embd, config.bias
        self.q = nn.Linear(d, d, bias=bias)
        self.k = nn.Linear(d, d, bias=bias)
        self.v = nn.Linear(d, d, bias=bias)
        self.o = nn.Linear(d, d, bias=bias)
        self.fc_in = nn.Linear(d, 4 * d, bias=bias)
        self.fc_out = nn.Linear(4 * d, d, bias=bias)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return linear(self.fc_out, gated_act(linear(self.fc_in, x), None, "gelu"))


def _norm(x: torch.Tensor) -> torch.Tensor:
    return rms_normalize(x, NORM_EPS).to(x.dtype)


@register_model
class LoopedTransformer(RecurrentLM):
    """The plain looped transformer (the authors' ``"lt"``)."""

    architecture = "lt"
    config_class = LoopedConfig
    config: LoopedConfig

    def __init__(self, config: LoopedConfig) -> None:
        super().__init__(config)
        problem = shape_problem(vars(config))
        if problem is not None:
            raise ValueError(problem)
        self.embed = nn.Embedding(config.vocab_size, config.n_embd)
        self.pos_embed = nn.Embedding(config.block_size, config.n_embd)
        self.block = LoopedBlock(config)
        self.final_norm = RMSNorm(config.n_embd, NORM_EPS)

    @property
    def max_model_len(self) -> int:
        return self.config.block_size

    def state_spec(self) -> list[StateSpec]:
        c = self.config
        shape = (c.n_loop, c.n_head, c.block_size, c.head_dim)
        dtype = self.embed.weight.dtype
        return [StateSpec("k", shape, dtype, 0.0), StateSpec("v", shape, dtype, 0.0)]

    def _loop(self, x: torch.Tensor, t: int, attend: Attend) -> torch.Tensor:
        """Loop ``t`` of the block on rows ``x [R, d]``; ``attend(q, k, v, t)`` is loop ``t``'s attention."""
        b, prenorm = self.block, self.config.prenorm_block
        n = _norm(x)
        x = x + linear(b.o, attend(linear(b.q, n), linear(b.k, n), linear(b.v, n if prenorm else x), t))
        return x + b.mlp(_norm(x) if prenorm else x)

    def _run(self, input_ids: torch.Tensor, positions: torch.Tensor, attend: Attend) -> torch.Tensor:
        x = self.embed(input_ids) + self.pos_embed(positions)
        for t in range(self.config.n_loop):
            x = self._loop(x, t, attend)
        return x

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        return matmul_t(self.final_norm(h), self.embed.weight, widened=True).float()

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(x.shape[0], self.config.n_head, self.config.head_dim)

    def prefill(self, batch: PrefillBatch, state: StateTensors) -> torch.Tensor:
        slots = batch.slot_ids.tolist()  # prefill indexes the caches per sequence, from the host

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, t: int) -> torch.Tensor:
            out = cached_attention_prefill(
                self._heads(q), self._heads(k), self._heads(v), state["k"][:, t], state["v"][:, t],
                slots, batch.starts, batch.lengths,
            )
            return out.flatten(1).to(q.dtype)

        h = self._run(batch.input_ids, batch.positions, attend)
        return self._logits(h[batch.logit_rows])

    def decode(self, batch: DecodeBatch, state: StateTensors) -> torch.Tensor:
        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, t: int) -> torch.Tensor:
            out = cached_attention_decode(
                self._heads(q), self._heads(k), self._heads(v), state["k"][:, t], state["v"][:, t],
                batch.slot_ids, batch.positions,
            )
            return out.flatten(1).to(q.dtype)

        return self._logits(self._run(batch.input_ids, batch.positions, attend))


@register_model
class TimestepModulatedLoopedTransformer(LoopedTransformer):
    """The timestep-modulated looped transformer (the authors' ``"tmlt"``)."""

    architecture = "tmlt"
    unquantized_linears = ("timestep_in", "timestep_out", "modulation")  # run once, into modulation_table

    def __init__(self, config: LoopedConfig) -> None:
        if config.prenorm_block:  # a plain-lt setting: tmlt's block normalises both inputs in every version
            raise ValueError("prenorm_block is a setting of the plain looped transformer (lt), not of tmlt")
        super().__init__(config)
        d = config.n_embd
        self.timestep_in = nn.Linear(TIMESTEP_FREQUENCIES, d)
        self.timestep_out = nn.Linear(d, d)
        self.modulation = nn.Linear(d, 4 * d)
        self.modulation_table = self._table()
        self.register_load_state_dict_post_hook(lambda module, _keys: module.refresh_modulation())

    def modulation_at(self, t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``[gate_attn, gate_mlp, scale_attn, scale_mlp]`` of loop indices ``t [N]`` -> ``[N, 4, d]``, computed
        step by step from the weights in ``dtype`` (default: theirs)."""
        w = self.timestep_in.weight
        dtype = dtype or w.dtype

        def apply(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
            return F.linear(x, layer.weight.to(dtype), None if layer.bias is None else layer.bias.to(dtype))

        frequencies = timestep_frequencies(t).to(w.device, dtype)
        embedding = apply(self.timestep_out, F.silu(apply(self.timestep_in, frequencies)))
        return apply(self.modulation, F.silu(embedding)).view(-1, 4, self.config.n_embd)

    @torch.no_grad()
    def _table(self) -> torch.Tensor:
        """The per-loop modulation computed in fp32 from the weights, rounded to their dtype: the same table whether
        a bf16 model was cast from fp32 in memory or loaded from a checkpoint (where the weights arrive in bf16)."""
        loops = torch.arange(self.config.n_loop, device=self.modulation.weight.device)
        dtype = torch.promote_types(self.modulation.weight.dtype, torch.float32)
        return self.modulation_at(loops, dtype).to(self.modulation.weight.dtype)

    def refresh_modulation(self) -> None:
        """Recompute the per-loop table from the current weights (after initialising or loading them)."""
        self.modulation_table = self._table()

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], *args: Any, **kwargs: Any) -> nn.Module:
        """Recompute the table from the moved or cast weights (``.to``, ``.cuda``, ``.half``)."""
        super()._apply(fn, *args, **kwargs)
        self.modulation_table = self._table()
        return self

    def init_weights(self, generator: torch.Generator | None = None) -> None:
        super().init_weights(generator)
        self.refresh_modulation()

    def _loop(self, x: torch.Tensor, t: int, attend: Attend) -> torch.Tensor:
        b = self.block
        gate_attn, gate_mlp, scale_attn, scale_mlp = self.modulation_table[t]
        n = _norm(x) * (1 + scale_attn)
        x = x + gate_attn * linear(b.o, attend(linear(b.q, n), linear(b.k, n), linear(b.v, n), t))
        return x + gate_mlp * b.mlp(_norm(x) * (1 + scale_mlp))


# The paper's WikiText-103 language models (App. C.3): one block of width 768 with 12 heads looped 24 times,
# GPT-2 BPE (the authors' 50304-row vocabulary), block size 1024.
register_preset("looped-wt103", "lt", n_embd=768, n_head=12, n_loop=24, block_size=1024, vocab_size=50304)
register_preset("tmlt-wt103", "tmlt", n_embd=768, n_head=12, n_loop=24, block_size=1024, vocab_size=50304)
register_preset("looped-tiny", "lt", n_embd=32, n_head=4, n_loop=3, block_size=64, vocab_size=320)
register_preset("tmlt-tiny", "tmlt", n_embd=32, n_head=4, n_loop=3, block_size=64, vocab_size=320)
