"""One Mamba-1 mixer decode step (in_proj, conv update, x_proj/dt_proj, selective state update, out_proj).

``naive.py`` is the reference, composed from the other ops' references; ``mamba_decode_cpu.cpp`` runs the
whole step as one fused CPU op that chains the CPU kernels of ``skinny_linear``, ``gemv``, ``causal_conv1d`` and
``selective_scan`` (and ATen GEMMs, chosen as :func:`rnnserve.engine.models.layers.matmul_t` chooses them)
without returning to Python between them.

:func:`mamba_decode_stack` runs every layer of a decode step (the mixer, then the residual add and the next
norm) in one op, saving the model's per-layer dispatches; on CPU it also takes weight-only quantized projections
(``--quantize int8`` or ``int4``), which it multiplies with the :mod:`rnnserve.kernels.int8_linear` or
:mod:`rnnserve.kernels.int4_linear` CPU kernel, as the quantized model's op-by-op step does. On a GPU, decode
batches of up to ``STACK_MAX_BATCH`` sequences with float projections run ``fused_recurrent.py``: three Triton
kernels per layer instead of the op-by-op step's eight launches (batch-1 decode is the weight stream plus a launch
and a tail per kernel); larger batches run the op-by-op step, whose GEMMs suit them (the kernels take up to
``fused_recurrent.MAX_ROWS``, 8), or with ``fused_recurrent.PERSISTENT`` set (off by default: unmeasured on a
GPU) ``persistent.py``'s single launch a step.
``STACK_ENABLED`` and ``STACK_MAX_BATCH`` are read on every call:
``RNNSERVE_MAMBA_STACK=0`` clears it at import, and clearing it runs the per-layer loop in the same process
(``benchmarks/cpu_decode.py`` compares both).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from rnnserve.kernels import gemv
from rnnserve.kernels.backend import use_triton
from rnnserve.kernels.cpu_extension import use_cpu_kernel
from rnnserve.kernels.gemv import row_limit
from rnnserve.kernels.mamba_decode.naive import mamba_mixer_decode_ref

MAX_STATE = 64  # the fused selective-scan kernels' d_state limit
STACK_ENABLED = os.environ.get("RNNSERVE_MAMBA_STACK", "1") != "0"
# H100, mamba-370m (benchmarks/decode_tune.py, 2026-11-27): the stack 1.32x the op-by-op step at batch 1,
# 0.66x at batch 8; the stack's time grows ~0.16 ms a row, the op-by-op step's ~0.007, so they cross near 3.
STACK_MAX_BATCH = 2


def mamba_mixer_decode_applies(h: torch.Tensor, conv_pool: torch.Tensor, ssm_pool: torch.Tensor) -> bool:
    """Whether :func:`mamba_mixer_decode` runs the fused CPU op for ``h [B, d_model]`` and these pool views
    (it has no autograd formula: only with gradients off, as the engine runs; conv widths 2-4, as the fused
    conv's)."""
    d_state = ssm_pool.shape[-1]
    return (
        h.dim() == 2
        and 1 <= conv_pool.shape[-1] <= 3
        and h.dtype in (torch.float32, torch.bfloat16)
        and conv_pool.dtype == torch.float32
        and conv_pool.stride(-1) == 1
        and ssm_pool.dtype == torch.float32
        and ssm_pool.stride(-1) == 1
        and ssm_pool.stride(-2) == d_state
        and d_state <= MAX_STATE
        and not torch.is_grad_enabled()
        and use_cpu_kernel(h)
    )


def mamba_decode_triton_applies(normed: torch.Tensor, conv_pool: torch.Tensor, ssm_pool: torch.Tensor) -> bool:
    """Whether :func:`mamba_decode_stack` runs the Triton stack for ``normed [B, d_model]`` and layer 0's pool
    views (the caller checks that the projections are float: the Triton stack takes no int8 ones)."""
    if not use_triton(normed) or ssm_pool.shape[-1] > MAX_STATE:
        return False
    from rnnserve.kernels.mamba_decode.fused_recurrent import stack_applies

    return normed.shape[0] <= STACK_MAX_BATCH and stack_applies(normed, conv_pool, ssm_pool)


def mamba_mixer_decode(
    h: torch.Tensor,
    in_proj_weight: torch.Tensor,
    in_proj_bias: torch.Tensor | None,
    conv_pool: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    slot_ids: torch.Tensor,
    x_proj_weight: torch.Tensor,
    dt_proj_weight: torch.Tensor,
    dt_bias: torch.Tensor,
    A: torch.Tensor,
    D: torch.Tensor,
    ssm_pool: torch.Tensor,
    out_proj_weight: torch.Tensor,
    out_proj_bias: torch.Tensor | None,
) -> torch.Tensor:
    """One decode step: ``h [B, d_model]`` -> ``out [B, d_model]`` in ``h``'s dtype, advancing this layer's
    pool views ``conv_pool [N, Di, K-1]`` and ``ssm_pool [N, Di, Ns]`` at rows ``slot_ids`` in place.

    Weights are in ``h``'s dtype; ``conv_weight [Di, K]``, ``dt_bias``, ``A = -exp(A_log)`` and ``D`` fp32 and
    contiguous (see :mod:`rnnserve.kernels.mamba_decode.naive`). The fused CPU op where
    :func:`mamba_mixer_decode_applies`, else the reference.
    """
    if not mamba_mixer_decode_applies(h, conv_pool, ssm_pool):
        return mamba_mixer_decode_ref(
            h,
            in_proj_weight,
            in_proj_bias,
            conv_pool,
            conv_weight,
            conv_bias,
            slot_ids,
            x_proj_weight,
            dt_proj_weight,
            dt_bias,
            A,
            D,
            ssm_pool,
            out_proj_weight,
            out_proj_bias,
        )
    return torch.ops.rnnserve.mamba_mixer_decode(
        h,
        in_proj_weight,
        in_proj_bias,
        conv_pool,
        conv_weight,
        conv_bias,
        slot_ids.long().contiguous(),
        x_proj_weight,
        dt_proj_weight,
        dt_bias,
        A,
        D,
        ssm_pool,
        out_proj_weight,
        out_proj_bias,
        gemv_row_limits(in_proj_weight, x_proj_weight, dt_proj_weight, out_proj_weight),
        gemv.UPCAST_BF16_GEMM,
        gemv.ONEDNN_FP32_GEMM,
    )


def gemv_row_limits(*weights: torch.Tensor) -> list[int]:
    """The gemv kernel's row limit for each projection of a mixer (in, x, dt, out), by its dtype and inputs, as
    ``matmul_t`` applies it (a quantized weight's limit is unused: it runs its own kernel)."""
    return [row_limit(w.dtype, w.shape[1]) for w in weights]


def mamba_decode_stack(
    normed: torch.Tensor,
    stream: torch.Tensor,
    norm_weights: Sequence[torch.Tensor],
    eps: float,
    layers: Sequence[Sequence[torch.Tensor | None]],
    conv_pool: torch.Tensor,
    ssm_pool: torch.Tensor,
    slot_ids: torch.Tensor,
) -> torch.Tensor:
    """All layers of a decode step in one CPU op (on a GPU: the Triton stack); returns the final norm's output
    ``[B, d_model]``.

    ``normed``/``stream``: the first block's input and the residual stream; ``norm_weights[i]``: block
    ``i + 1``'s norm weight, the last one the final norm's (the final norm keeps the stream's precision, see
    :func:`~rnnserve.kernels.residual_rms_norm.residual_rms_norm`); ``layers[i]``: layer ``i``'s
    :func:`mamba_mixer_decode` arguments ``(in_proj_weight, in_proj_bias, conv_weight, conv_bias,
    x_proj_weight, dt_proj_weight, dt_bias, A, D, out_proj_weight, out_proj_bias)`` followed by
    ``(in_proj_scale, x_proj_scale, out_proj_scale)``: None for a weight in the model's dtype, the fp32
    per-row scale ``[N]`` of an int8 weight ``[N, K]`` (:class:`~rnnserve.engine.quantize.Int8Linear`) or the fp16
    group scales of a packed int4 weight (:class:`~rnnserve.engine.quantize.Int4Linear`);
    ``dt_proj_weight`` is always in the model's dtype. ``conv_pool [N, L, Di, K-1]`` and ``ssm_pool [N, L, Di,
    Ns]``: the whole pools, advanced in place at rows ``slot_ids``. Callers check
    :func:`mamba_mixer_decode_applies` (or :func:`mamba_decode_triton_applies`) on layer 0's pool views and
    ``STACK_ENABLED`` first.
    """
    if use_triton(normed):
        from rnnserve.kernels.mamba_decode import fused_recurrent

        if fused_recurrent.PERSISTENT:
            from rnnserve.kernels.mamba_decode.persistent import mamba_decode_stack_persistent

            return mamba_decode_stack_persistent(normed, stream, norm_weights, eps, layers, conv_pool, ssm_pool,
                                                 slot_ids)
        return fused_recurrent.mamba_decode_stack_triton(normed, stream, norm_weights, eps, layers, conv_pool,
                                                         ssm_pool, slot_ids)
    in_w, in_b, conv_w, conv_b, x_w, dt_w, dt_b, a, d, out_w, out_b, in_s, x_s, out_s = (
        list(column) for column in zip(*layers, strict=True)
    )
    return torch.ops.rnnserve.mamba_decode_stack(
        normed,
        stream,
        [w.contiguous() for w in norm_weights],
        eps,
        in_w,
        in_b,
        conv_pool,
        conv_w,
        conv_b,
        slot_ids.long().contiguous(),
        x_w,
        dt_w,
        dt_b,
        a,
        d,
        ssm_pool,
        out_w,
        out_b,
        in_s,
        x_s,
        out_s,
        gemv_row_limits(in_w[0], x_w[0], dt_w[0], out_w[0]),
        gemv.UPCAST_BF16_GEMM,
        gemv.ONEDNN_FP32_GEMM,
    )


__all__ = [
    "MAX_STATE",
    "STACK_ENABLED",
    "STACK_MAX_BATCH",
    "mamba_decode_stack",
    "mamba_decode_triton_applies",
    "mamba_mixer_decode",
    "mamba_mixer_decode_applies",
]
