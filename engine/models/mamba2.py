"""Mamba-2 language model in the Hugging Face ``Mamba2ForCausalLM`` layout.

Block (pre-norm, residual)::

    z, xBC, dt = in_proj(RMSNorm(h)).split(d_inner, d_inner + 2 G N, H)
    x, B, C    = silu(conv1d_causal(xBC)).split(d_inner, G N, G N)    # state: last d_conv-1 inputs
    dt         = clamp(softplus(dt + dt_bias), *time_step_limit)
    y          = SSD(x as [H, P], dt, A = -exp(A_log), B, C as [G, N]) + D x   # state: [H, P, N] per layer
    h          = h + out_proj(GroupRMSNorm(y * silu(z)))     # statistics per group of d_inner / G channels

The stack around the mixer is :class:`~rnnserve.engine.models.layers.mixer_stack.MixerStackLM`. Parameter
names equal the Hugging Face ones. Conv tail and SSD state are kept in fp32.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from rnnserve.engine.models.base import (
    ModelConfig,
    StateSpec,
    StateTensors,
    config_bool,
    register_model,
    register_preset,
)
from rnnserve.engine.models.layers import MixerStackLM, linear
from rnnserve.kernels import mamba2_decode as mamba2_decode_ops
from rnnserve.kernels.causal_conv1d import causal_conv1d_update, causal_conv1d_varlen
from rnnserve.kernels.gated_rms_norm import gated_rms_norm
from rnnserve.kernels.mamba2_decode import mamba2_decode_stack, mamba2_mixer_step, mamba2_mixer_step_applies
from rnnserve.kernels.ssd import discretize_dt, ssd_scan_varlen, ssd_state_update


def _json_float(value: float | str | dict) -> float:
    """A float from config.json; ``transformers`` writes infinities as ``{"__float__": "Infinity"}``."""
    return float(value["__float__"]) if isinstance(value, dict) else float(value)


@dataclass
class Mamba2Config(ModelConfig):
    vocab_size: int = 50280
    d_model: int = 768
    n_layers: int = 24
    n_heads: int = 24
    head_dim: int = 64
    d_state: int = 128
    n_groups: int = 1
    d_conv: int = 4
    use_bias: bool = False
    use_conv_bias: bool = True
    norm_eps: float = 1e-5
    gated_norm_eps: float | None = None  # the gated RMSNorm's (mamba_ssm fixes it at 1e-5); None: norm_eps
    dt_min_limit: float = 0.0
    dt_max_limit: float = math.inf
    tie_embeddings: bool = True
    chunk_size: int = 64
    residual_in_fp32: bool = True

    @property
    def d_inner(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def mixer_norm_eps(self) -> float:
        """The eps of the gated RMSNorm before out_proj (``transformers`` uses ``layer_norm_epsilon`` for it too)."""
        return self.norm_eps if self.gated_norm_eps is None else self.gated_norm_eps

    @property
    def conv_dim(self) -> int:
        return self.d_inner + 2 * self.n_groups * self.d_state


class GatedGroupRMSNorm(nn.Module):
    """``RMSNorm(y * silu(z))`` with statistics per group of channels, in fp32 (one Triton kernel on GPUs:
    :mod:`rnnserve.kernels.gated_rms_norm`)."""

    def __init__(self, dim: int, groups: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.groups = groups
        self.eps = eps

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(y, z, self.weight, self.groups, self.eps)


class Mamba2Mixer(nn.Module):
    def __init__(self, config: Mamba2Config) -> None:
        super().__init__()
        c = config
        self.config = c
        self.in_proj = nn.Linear(c.d_model, c.d_inner + c.conv_dim + c.n_heads, bias=c.use_bias)
        self.conv1d = nn.Conv1d(c.conv_dim, c.conv_dim, c.d_conv, groups=c.conv_dim, bias=c.use_conv_bias)
        self.dt_bias = nn.Parameter(torch.empty(c.n_heads))
        self.A_log = nn.Parameter(torch.empty(c.n_heads))
        self.D = nn.Parameter(torch.empty(c.n_heads))
        self.norm = GatedGroupRMSNorm(c.d_inner, c.n_groups, c.mixer_norm_eps)
        self.out_proj = nn.Linear(c.d_inner, c.d_model, bias=c.use_bias)

    def _split(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        c = self.config
        projected = linear(self.in_proj, h)
        return projected.split([c.d_inner, c.conv_dim, c.n_heads], dim=-1)

    def _ssd_inputs(
        self, xbc: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``xBC [N, conv_dim]`` after the conv and its SiLU -> ``x [N, H, P]``, ``A [H]``, ``B, C [N, G, N]``."""
        c = self.config
        x, B, C = xbc.split([c.d_inner, c.n_groups * c.d_state, c.n_groups * c.d_state], dim=-1)
        groups = (c.n_groups, c.d_state)
        A = -torch.exp(self.A_log.float())
        return x.unflatten(-1, (c.n_heads, c.head_dim)), A, B.unflatten(-1, groups), C.unflatten(-1, groups)

    @property
    def _dt_limit(self) -> tuple[float, float]:
        return self.config.dt_min_limit, self.config.dt_max_limit

    def prefill(
        self, h: torch.Tensor, cu_seqlens: torch.Tensor, slot_ids: torch.Tensor, conv_pool: torch.Tensor,
        ssm_pool: torch.Tensor,
    ) -> torch.Tensor:
        z, xbc, dt = self._split(h)
        # The conv kernels apply F.silu's rounding to their rounded output (the PyTorch path runs F.silu itself).
        xbc, _ = causal_conv1d_varlen(
            xbc, self.conv1d.weight[:, 0], self.conv1d.bias, cu_seqlens, conv_pool, silu=True, slot_ids=slot_ids
        )
        x, A, B, C = self._ssd_inputs(xbc)
        # dt's bias, softplus and clamp happen inside the scan (in-kernel on GPUs: no elementwise launches).
        y, _ = ssd_scan_varlen(x, dt, A, B, C, cu_seqlens, self.D, ssm_pool, self.config.chunk_size,
                               dt_bias=self.dt_bias, dt_softplus=True, dt_limit=self._dt_limit, slot_ids=slot_ids)
        return linear(self.out_proj, self.norm(y.flatten(1), z))

    def decode(
        self,
        h: torch.Tensor,
        slot_ids: torch.Tensor,
        slots: torch.Tensor | slice,
        conv_pool: torch.Tensor,
        ssm_pool: torch.Tensor,
    ) -> torch.Tensor:
        """One token per sequence; the pool views are updated in place (``slots``: see
        :func:`~rnnserve.engine.models.layers.slots.slot_index`). On CPU everything between the conv update
        and out_proj is one op (:mod:`rnnserve.kernels.mamba2_decode`)."""
        z, xbc, dt = self._split(h)
        xbc = causal_conv1d_update(xbc, conv_pool, self.conv1d.weight[:, 0], self.conv1d.bias, slot_ids)
        if mamba2_mixer_step_applies(xbc, dt, z, ssm_pool, self.norm.weight):
            params = (self.dt_bias, self.A_log, self.D, self.norm.weight, self.norm.groups, self.norm.eps,
                      *self._dt_limit)
            return linear(self.out_proj, mamba2_mixer_step(xbc, dt, z, ssm_pool, slot_ids, *params))
        x, A, B, C = self._ssd_inputs(F.silu(xbc))
        dt = discretize_dt(dt, self.dt_bias, dt_softplus=True, dt_limit=self._dt_limit)
        y = ssd_state_update(ssm_pool, slots, x, dt, A, B, C, self.D, slot_ids)
        return linear(self.out_proj, self.norm(y.flatten(1), z))


@register_model
class Mamba2LM(MixerStackLM):
    """Mamba-2 (``Mamba2ForCausalLM``): multi-head SSD with grouped B/C and a gated group RMSNorm."""

    architecture = "mamba2"
    config_class = Mamba2Config
    hf_model_types = ("mamba2",)
    mixer = Mamba2Mixer

    def __init__(self, config: Mamba2Config) -> None:
        if config.n_heads % config.n_groups:
            raise ValueError(f"n_heads {config.n_heads} is not a multiple of n_groups {config.n_groups}")
        super().__init__(config)

    def _decode_layers(
        self, normed: torch.Tensor, stream: torch.Tensor, slot_ids: torch.Tensor, state: StateTensors
    ) -> torch.Tensor:
        """On a GPU, small batches with float projections run every layer in the Triton stack
        (:func:`~rnnserve.kernels.mamba2_decode.mamba2_decode_stack`); everything else the per-layer loop."""
        conv, ssm = state["conv"], state["ssm"]
        if not mamba2_decode_ops.mamba2_decode_triton_applies(normed, conv, ssm):  # checked first: it is cheap
            return super()._decode_layers(normed, stream, slot_ids, state)
        layers = self.backbone.layers
        mixers = [block.mixer for block in layers]
        if not all(m.in_proj.weight.is_floating_point() and m.out_proj.weight.is_floating_point() for m in mixers):
            return super()._decode_layers(normed, stream, slot_ids, state)
        norms = [block.norm.weight for block in layers[1:]] + [self.backbone.norm_f.weight]
        weights = [
            (m.in_proj.weight, m.in_proj.bias, m.conv1d.weight[:, 0], m.conv1d.bias, m.dt_bias, m.A_log, m.D,
             m.norm.weight, m.out_proj.weight, m.out_proj.bias)
            for m in mixers
        ]  # fmt: skip
        c = self.config
        return mamba2_decode_stack(normed, stream, norms, c.norm_eps, weights, conv, ssm, slot_ids, c.n_groups,
                                   c.mixer_norm_eps, (c.dt_min_limit, c.dt_max_limit))  # fmt: skip

    @classmethod
    def from_hf_config(cls, hf: Mapping[str, Any]) -> Mamba2Config:
        """Map a Hugging Face ``mamba2`` config.json to :class:`Mamba2Config`."""
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {hf['hidden_act']!r} is not supported (Mamba-2 uses silu)")
        heads, head_dim = hf["num_heads"], hf["head_dim"]
        if int(hf.get("expand", 2) * hf["hidden_size"]) != heads * head_dim:
            raise ValueError("expand * hidden_size must equal num_heads * head_dim")
        # transformers 4's field, written from mamba_ssm's ssm_cfg["rmsnorm"] by its conversion script; transformers
        # always builds the gated norm, so a model trained without it would be served as another one
        if not config_bool(hf.get("rms_norm", True), "rms_norm"):
            raise ValueError(f"rms_norm {hf['rms_norm']!r}: a Mamba-2 without its gated RMSNorm is not supported")
        low, high = hf.get("time_step_limit", (0.0, math.inf))
        return Mamba2Config(
            vocab_size=hf["vocab_size"],
            d_model=hf["hidden_size"],
            n_layers=hf["num_hidden_layers"],
            n_heads=heads,
            head_dim=head_dim,
            d_state=hf.get("state_size", 128),
            n_groups=hf.get("n_groups", 1),
            d_conv=hf.get("conv_kernel", 4),
            use_bias=config_bool(hf.get("use_bias", False), "use_bias"),
            use_conv_bias=config_bool(hf.get("use_conv_bias", True), "use_conv_bias"),
            norm_eps=hf.get("layer_norm_epsilon", 1e-5),
            dt_min_limit=_json_float(low),
            dt_max_limit=_json_float(high),
            tie_embeddings=config_bool(hf.get("tie_word_embeddings", False), "tie_word_embeddings"),
            residual_in_fp32=config_bool(hf.get("residual_in_fp32", True), "residual_in_fp32"),
        )

    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """Mamba-2's initialisation: ``A`` in 1..H, ``D = 1``, ``dt`` log-uniform in [1e-3, 0.1]."""
        super().init_weights(generator)
        c = self.config
        for block in self.backbone.layers:
            mixer = block.mixer
            mixer.A_log.data.copy_(torch.log(torch.arange(1, c.n_heads + 1, dtype=torch.float32)))
            mixer.D.data.fill_(1.0)
            u = torch.rand(c.n_heads, generator=generator)
            dt = torch.exp(u * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
            mixer.dt_bias.data.copy_(dt + torch.log(-torch.expm1(-dt)))
            nn.init.normal_(mixer.conv1d.weight, std=c.d_conv**-0.5, generator=generator)
            if mixer.conv1d.bias is not None:
                nn.init.zeros_(mixer.conv1d.bias)
        nn.init.normal_(self.backbone.embeddings.weight, std=0.02, generator=generator)

    def state_spec(self) -> list[StateSpec]:
        c = self.config
        return [
            StateSpec("conv", (c.n_layers, c.conv_dim, c.d_conv - 1), torch.float32, 0.0),
            StateSpec("ssm", (c.n_layers, c.n_heads, c.head_dim, c.d_state), torch.float32, 0.0),
        ]


register_preset(
    "mamba2-tiny", "mamba2", vocab_size=320, d_model=64, n_layers=2, n_heads=4, head_dim=32, d_state=16
)
# The Mamba-2 paper's language models: expand 2, head_dim 64, d_state 128, one B/C group.
for _name, _width, _depth in (
    ("130m", 768, 24),
    ("370m", 1024, 48),
    ("780m", 1536, 48),
    ("1.3b", 2048, 48),
    ("2.7b", 2560, 64),
):
    register_preset(f"mamba2-{_name}", "mamba2", d_model=_width, n_layers=_depth, n_heads=2 * _width // 64)
