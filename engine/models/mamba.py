"""Mamba-1 and FalconMamba language models in the Hugging Face ``MambaForCausalLM`` layout.

Block (pre-norm, residual)::

    x, z  = in_proj(RMSNorm(h)).chunk(2)              # d_inner each
    x     = silu(conv1d_causal(x))                     # depthwise, kernel d_conv; state: last d_conv-1 inputs
    dt, B, C = x_proj(x).split(dt_rank, N, N)          # FalconMamba: weightless RMSNorm on dt, B and C
    dt    = softplus(dt_proj(dt))                      # back to d_inner
    y     = selective_scan(x, dt, A=-exp(A_log), B, C, D) * silu(z)    # state: [d_inner, N]
    h     = h + out_proj(y)                            # the stream h is fp32 when residual_in_fp32 (default)

The stack around the mixer is :class:`~rnnserve.engine.models.layers.mixer_stack.MixerStackLM`. Parameter
names equal the Hugging Face ones, so checkpoints load without renaming (except the legacy
``backbone.embedding.`` prefix). Both states are kept in fp32.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from rnnserve.engine.models.base import (
    ModelConfig,
    StateSpec,
    StateTensors,
    config_bool,
    register_model,
    register_preset,
)
from rnnserve.engine.models.layers import MixerStackLM, linear, matmul_t, weightless_rms_norm
from rnnserve.engine.quantize import Int4Linear, Int8Linear
from rnnserve.kernels import mamba_decode as mamba_decode_ops
from rnnserve.kernels.causal_conv1d import causal_conv1d_update, causal_conv1d_varlen
from rnnserve.kernels.mamba_decode import (
    mamba_decode_stack,
    mamba_decode_triton_applies,
    mamba_mixer_decode,
    mamba_mixer_decode_applies,
)
from rnnserve.kernels.selective_scan import selective_scan_varlen, selective_state_update


@dataclass
class MambaConfig(ModelConfig):
    vocab_size: int = 50280
    d_model: int = 768
    n_layers: int = 24
    d_inner: int = 1536
    d_state: int = 16
    d_conv: int = 4
    dt_rank: int = 48
    use_bias: bool = False
    use_conv_bias: bool = True
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    bcdt_rms_norm: bool = False
    mixer_rms_eps: float = 1e-6
    scan_chunk_size: int = 32
    residual_in_fp32: bool = True


VersionKey = tuple[int, int, torch.device]
"""A tensor's storage address, version counter and device (:func:`_version_key`)."""
FP32Params = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]
"""``(A, D, dt_bias, conv weight, conv bias)`` in fp32 (:meth:`MambaMixer._fp32_params`)."""


def _version_key(t: torch.Tensor | None) -> VersionKey | None:
    """Identifies a tensor's current contents: storage, version counter (-1 for inference tensors), device.

    Inference tensors are asked first: reading their ``_version`` raises, and a caught C++ error with its
    backtrace costs about 10 us, five times per layer and decode step."""
    if t is None:
        return None
    return t.data_ptr(), -1 if t.is_inference() else t._version, t.device


def _linear_tensors(layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(weight, bias, scale)`` of an ``nn.Linear`` (scale None), an :class:`Int8Linear` or an
    :class:`Int4Linear` (the fused stack tells them apart by the weight's dtype).

    Decode reads every layer's tensors on every step, so these (and the mixer's) are looked up in the modules'
    ``_parameters``/``_buffers``/``_modules`` dicts: ``nn.Module`` attribute access costs about 1 us each,
    which came to 0.9 ms of a 19 ms batch-1 step of mamba-130m."""
    if isinstance(layer, Int8Linear | Int4Linear):
        return layer._buffers["weight"], layer._parameters.get("bias"), layer._buffers["scale"]
    return layer._parameters["weight"], layer._parameters["bias"], None


class MambaMixer(nn.Module):
    unquantized_linears = ("dt_proj",)  # its weight is multiplied without the bias, which the scan adds

    def __init__(self, config: MambaConfig) -> None:
        super().__init__()
        c = config
        self.config = c
        self.in_proj = nn.Linear(c.d_model, 2 * c.d_inner, bias=c.use_bias)
        self.conv1d = nn.Conv1d(c.d_inner, c.d_inner, c.d_conv, groups=c.d_inner, bias=c.use_conv_bias)
        self.x_proj = nn.Linear(c.d_inner, c.dt_rank + 2 * c.d_state, bias=False)
        self.dt_proj = nn.Linear(c.dt_rank, c.d_inner, bias=True)
        self.A_log = nn.Parameter(torch.empty(c.d_inner, c.d_state))
        self.D = nn.Parameter(torch.empty(c.d_inner))
        self.out_proj = nn.Linear(c.d_inner, c.d_model, bias=c.use_bias)
        self._fp32_key: tuple[VersionKey | None, ...] | None = None
        self._fp32_cache: FP32Params | None = None
        self.register_load_state_dict_post_hook(self._forget_derived)

    def _ssm_inputs(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x [*, Di]`` (after conv + SiLU) -> ``(dt, B, C)``; the scan adds dt's bias and softplus."""
        c = self.config
        projected = linear(self.x_proj, x)
        dt, B, C = projected.split([c.dt_rank, c.d_state, c.d_state], dim=-1)
        if c.bcdt_rms_norm:
            dt, B, C = (weightless_rms_norm(t, c.mixer_rms_eps) for t in (dt, B, C))
        return matmul_t(dt, self.dt_proj.weight), B, C

    def _fp32_params(self) -> FP32Params:
        """``(A = -exp(A_log), D, dt_bias, conv weight [Di, K], conv bias)`` in fp32 and contiguous, as the
        kernels read them; recomputed only when a parameter changes (decode would convert them every step).

        A change is a new tensor, an in-place update of a normal tensor, or a ``load_state_dict`` (inference
        tensors carry no version counter)."""
        params, conv = self._parameters, self._modules["conv1d"]._parameters
        sources = (params["A_log"], params["D"], self._modules["dt_proj"]._parameters["bias"], conv["weight"],
                   conv["bias"])
        key = tuple(_version_key(p) for p in sources)
        cache = self._fp32_cache
        if cache is None or self._fp32_key != key:
            cache = (
                -torch.exp(self.A_log.detach().float()),
                self.D.detach().float().contiguous(),
                self.dt_proj.bias.detach().float().contiguous(),
                self.conv1d.weight.detach()[:, 0, :].float().contiguous(),
                None if self.conv1d.bias is None else self.conv1d.bias.detach().float().contiguous(),
            )
            self._fp32_cache, self._fp32_key = cache, key
        return cache

    def _forget_derived(self, *_: Any) -> None:
        self._fp32_key = None

    def prefill(
        self, h: torch.Tensor, cu_seqlens: torch.Tensor, slot_ids: torch.Tensor, conv_pool: torch.Tensor,
        ssm_pool: torch.Tensor,
    ) -> torch.Tensor:
        A, D, dt_bias, conv_weight, conv_bias = self._fp32_params()
        x, z = linear(self.in_proj, h).chunk(2, dim=-1)
        x, _ = causal_conv1d_varlen(x, conv_weight, conv_bias, cu_seqlens, conv_pool, silu=True, slot_ids=slot_ids)
        dt, B, C = self._ssm_inputs(x)
        y, _ = selective_scan_varlen(
            x, dt, A, B, C, cu_seqlens, D, z, ssm_pool, dt_bias, True, self.config.scan_chunk_size, h.dtype, slot_ids
        )
        return linear(self.out_proj, y)

    def fused_weights(self) -> bool:
        """Whether the projections are plain float weights, which the per-layer fused op takes (quantized ones,
        engine/quantize.py, only go through the one-op stack)."""
        return all(layer.weight.is_floating_point() for layer in (self.in_proj, self.x_proj, self.out_proj))

    def fused_decode_applies(self, h: torch.Tensor, conv_pool: torch.Tensor, ssm_pool: torch.Tensor) -> bool:
        """Whether :meth:`decode` runs the fused per-layer CPU op (float projections only)."""
        return self.fused_weights() and not self.config.bcdt_rms_norm and mamba_mixer_decode_applies(
            h, conv_pool, ssm_pool
        )

    def stack_decode_applies(self, h: torch.Tensor, conv_pool: torch.Tensor, ssm_pool: torch.Tensor) -> bool:
        """Whether this mixer's step can run in the one-op stack: on CPU with float or quantized projections, on a
        GPU (small batches) with float ones; not for FalconMamba's extra norms."""
        if self.config.bcdt_rms_norm:
            return False
        if mamba_decode_triton_applies(h, conv_pool, ssm_pool):
            return self.fused_weights()
        return mamba_mixer_decode_applies(h, conv_pool, ssm_pool)

    def fused_decode_weights(self) -> tuple[torch.Tensor | None, ...]:
        """The fused ops' per-layer arguments: ``(in_proj_weight, in_proj_bias, conv_weight, conv_bias,
        x_proj_weight, dt_proj_weight, dt_bias, A, D, out_proj_weight, out_proj_bias, in_proj_scale,
        x_proj_scale, out_proj_scale)``, each scale None unless that projection is quantized."""
        A, D, dt_bias, conv_weight, conv_bias = self._fp32_params()
        children = self._modules
        in_w, in_b, in_s = _linear_tensors(children["in_proj"])
        x_w, _, x_s = _linear_tensors(children["x_proj"])
        out_w, out_b, out_s = _linear_tensors(children["out_proj"])
        dt_w = children["dt_proj"]._parameters["weight"]
        return in_w, in_b, conv_weight, conv_bias, x_w, dt_w, dt_bias, A, D, out_w, out_b, in_s, x_s, out_s

    def decode(
        self,
        h: torch.Tensor,
        slot_ids: torch.Tensor,
        slots: torch.Tensor | slice,
        conv_pool: torch.Tensor,
        ssm_pool: torch.Tensor,
    ) -> torch.Tensor:
        """One token per sequence; ``conv_pool``, ``ssm_pool``: this layer's pool views, updated in place.

        ``slots`` is ``slot_ids`` or, for consecutive ids, the equivalent slice (see
        :func:`~rnnserve.engine.models.layers.slots.slot_index`). On CPU the whole step is one fused op
        (:mod:`rnnserve.kernels.mamba_decode`).
        """
        if self.fused_decode_applies(h, conv_pool, ssm_pool):
            in_w, in_b, conv_w, conv_b, x_w, dt_w, dt_b, A, D, out_w, out_b, *_ = self.fused_decode_weights()
            return mamba_mixer_decode(
                h, in_w, in_b, conv_pool, conv_w, conv_b, slot_ids, x_w, dt_w, dt_b, A, D, ssm_pool, out_w, out_b
            )
        return self.decode_unfused(h, slot_ids, slots, conv_pool, ssm_pool)

    def decode_unfused(
        self,
        h: torch.Tensor,
        slot_ids: torch.Tensor,
        slots: torch.Tensor | slice,
        conv_pool: torch.Tensor,
        ssm_pool: torch.Tensor,
    ) -> torch.Tensor:
        """:meth:`decode` op by op: the path off CPU, for FalconMamba, and the fused op's reference."""
        A, D, dt_bias, conv_weight, conv_bias = self._fp32_params()
        x, z = linear(self.in_proj, h).chunk(2, dim=-1)
        x = causal_conv1d_update(x, conv_pool, conv_weight, conv_bias, slot_ids, silu=True)
        dt, B, C = self._ssm_inputs(x)
        y = selective_state_update(ssm_pool, slots, x, dt, A, B, C, D, z, dt_bias, True, slot_ids)
        return linear(self.out_proj, y.to(h.dtype))


@register_model
class MambaLM(MixerStackLM):
    """Mamba-1 (``MambaForCausalLM``); with ``bcdt_rms_norm`` FalconMamba (``FalconMambaForCausalLM``)."""

    architecture = "mamba"
    config_class = MambaConfig
    hf_model_types = ("mamba", "falcon_mamba")
    mixer = MambaMixer

    def _decode_layers(
        self, normed: torch.Tensor, stream: torch.Tensor, slot_ids: torch.Tensor, state: StateTensors
    ) -> torch.Tensor:
        """Every layer in one fused op (:func:`~rnnserve.kernels.mamba_decode.mamba_decode_stack`): on CPU
        with float or quantized (``--quantize``) projections, on a GPU the Triton stack for small batches."""
        layers = self.backbone.layers
        conv, ssm = state["conv"], state["ssm"]
        if not (mamba_decode_ops.STACK_ENABLED and layers[0].mixer.stack_decode_applies(normed, conv[:, 0], ssm[:, 0])):
            return super()._decode_layers(normed, stream, slot_ids, state)
        blocks = [block._modules for block in layers]  # dict lookups: see _linear_tensors
        norms = [block["norm"]._parameters["weight"] for block in blocks[1:]]
        norms.append(self.backbone.norm_f.weight)
        weights = [block["mixer"].fused_decode_weights() for block in blocks]
        return mamba_decode_stack(normed, stream, norms, self.config.norm_eps, weights, conv, ssm, slot_ids)

    @classmethod
    def from_hf_config(cls, hf: Mapping[str, Any]) -> MambaConfig:
        """Map a Hugging Face ``mamba``/``falcon_mamba`` config.json to :class:`MambaConfig`."""
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {hf['hidden_act']!r} is not supported (Mamba uses silu)")
        d_model = hf["hidden_size"]
        dt_rank = hf.get("time_step_rank", "auto")
        d_inner = int(hf.get("expand", 2) * d_model)  # transformers derives intermediate_size from expand, always
        if hf.get("intermediate_size") not in (None, d_inner):
            raise ValueError(
                f"intermediate_size {hf['intermediate_size']} disagrees with expand {hf.get('expand', 2)} x "
                f"hidden_size {d_model} = {d_inner}, which transformers uses in its place"
            )
        return MambaConfig(
            vocab_size=hf["vocab_size"],
            d_model=d_model,
            n_layers=hf["num_hidden_layers"],
            d_inner=d_inner,
            d_state=hf.get("state_size", 16),
            d_conv=hf.get("conv_kernel", 4),
            dt_rank=math.ceil(d_model / 16) if dt_rank == "auto" else int(dt_rank),
            use_bias=config_bool(hf.get("use_bias", False), "use_bias"),
            use_conv_bias=config_bool(hf.get("use_conv_bias", True), "use_conv_bias"),
            norm_eps=hf.get("layer_norm_epsilon", 1e-5),
            tie_embeddings=config_bool(hf.get("tie_word_embeddings", True), "tie_word_embeddings"),
            bcdt_rms_norm=hf["model_type"] == "falcon_mamba",
            mixer_rms_eps=hf.get("mixer_rms_eps", 1e-6),
            residual_in_fp32=config_bool(hf.get("residual_in_fp32", True), "residual_in_fp32"),
        )

    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """Mamba's initialisation: S4D-real ``A``, ``D = 1``, ``dt`` log-uniform in [1e-3, 0.1]."""
        super().init_weights(generator)
        c = self.config
        for block in self.backbone.layers:
            mixer = block.mixer
            a = torch.arange(1, c.d_state + 1, dtype=torch.float32).expand(c.d_inner, -1)
            mixer.A_log.data.copy_(torch.log(a))
            mixer.D.data.fill_(1.0)
            nn.init.uniform_(mixer.dt_proj.weight, -(c.dt_rank**-0.5), c.dt_rank**-0.5, generator=generator)
            dt = torch.exp(
                torch.rand(c.d_inner, generator=generator) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3)
            )
            mixer.dt_proj.bias.data.copy_(dt + torch.log(-torch.expm1(-dt)))
            nn.init.normal_(mixer.conv1d.weight, std=c.d_conv**-0.5, generator=generator)
            if mixer.conv1d.bias is not None:
                nn.init.zeros_(mixer.conv1d.bias)
        nn.init.normal_(self.backbone.embeddings.weight, std=0.02, generator=generator)

    def state_spec(self) -> list[StateSpec]:
        c = self.config
        return [
            StateSpec("conv", (c.n_layers, c.d_inner, c.d_conv - 1), torch.float32, 0.0),
            StateSpec("ssm", (c.n_layers, c.d_inner, c.d_state), torch.float32, 0.0),
        ]


register_preset("mamba-tiny", "mamba", vocab_size=320, d_model=64, n_layers=2, d_inner=128, dt_rank=4)
register_preset("mamba-130m", "mamba", d_model=768, n_layers=24, d_inner=1536, dt_rank=48)
register_preset("mamba-370m", "mamba", d_model=1024, n_layers=48, d_inner=2048, dt_rank=64)
register_preset("mamba-790m", "mamba", d_model=1536, n_layers=48, d_inner=3072, dt_rank=96)
register_preset("mamba-1.4b", "mamba", d_model=2048, n_layers=48, d_inner=4096, dt_rank=128)
register_preset("mamba-2.8b", "mamba", d_model=2560, n_layers=64, d_inner=5120, dt_rank=160, vocab_size=50280)
