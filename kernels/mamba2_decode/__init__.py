"""The middle of a Mamba-2 mixer decode step: SiLU on ``xBC``, ``dt`` discretisation, the SSD state update in
the pool, and the gated per-group RMSNorm (everything between the conv update and ``out_proj``).

``naive.py`` is the reference. ``mamba2_decode_cpu.cpp`` runs it as one CPU op (calling the SSD state update's
CPU kernel) instead of about 30 PyTorch ops per layer. Off CPU, and for layouts the op does not take, the model
runs its op-by-op step, which reaches the Triton SSD kernel on a GPU.

On a GPU, decode batches of up to ``STACK_MAX_BATCH`` sequences with float projections run the whole stack in
``fused_recurrent.py`` (:func:`mamba2_decode_stack`): three Triton kernels a layer, the in_proj and out_proj GEMVs
with the norms, the conv and the SSD update fused around them (the kernels take up to
``mamba_decode.fused_recurrent.MAX_ROWS``, 8). ``STACK_ENABLED`` and ``STACK_MAX_BATCH`` are read on every call
(``RNNSERVE_MAMBA_STACK=0`` clears the first at import, as for Mamba-1), and so is ``fused_recurrent.PERSISTENT``,
which runs the stack as one persistent launch a step (``persistent.py``) instead.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from rnnserve.kernels.backend import use_triton
from rnnserve.kernels.cpu_extension import use_cpu_kernel
from rnnserve.kernels.mamba2_decode.naive import mamba2_mixer_step_ref

STACK_ENABLED = os.environ.get("RNNSERVE_MAMBA_STACK", "1") != "0"
# H100, mamba2-370m (benchmarks/decode_tune.py, 2026-11-27): the stack 1.93x the op-by-op step at batch 1,
# 0.93x at batch 8; the stack's time grows ~0.2 ms a row, the op-by-op step's ~0.05, so they cross near 7.
STACK_MAX_BATCH = 4


def mamba2_decode_triton_applies(normed: torch.Tensor, conv_pool: torch.Tensor, ssm_pool: torch.Tensor) -> bool:
    """Whether :func:`mamba2_decode_stack` runs for ``normed [B, d_model]`` and the whole pools ``conv_pool [N, L,
    conv_dim, K-1]``, ``ssm_pool [N, L, H, P, Ns]`` (the caller checks that the projections are float)."""
    if not (STACK_ENABLED and use_triton(normed)):
        return False
    from rnnserve.kernels.mamba_decode.fused_recurrent import stack_applies

    return normed.shape[0] <= STACK_MAX_BATCH and stack_applies(normed, conv_pool, ssm_pool)


def mamba2_decode_stack(
    normed: torch.Tensor,
    stream: torch.Tensor,
    norm_weights: Sequence[torch.Tensor],
    eps: float,
    layers: Sequence[Sequence[torch.Tensor | None]],
    conv_pool: torch.Tensor,
    ssm_pool: torch.Tensor,
    slot_ids: torch.Tensor,
    groups: int,
    gated_eps: float,
    dt_limits: tuple[float, float],
) -> torch.Tensor:
    """Every layer of a decode step where :func:`mamba2_decode_triton_applies`; returns the final norm's output
    (arguments: :func:`~rnnserve.kernels.mamba2_decode.fused_recurrent.mamba2_decode_stack_triton`)."""
    from rnnserve.kernels.mamba2_decode import fused_recurrent
    from rnnserve.kernels.mamba2_decode.persistent import mamba2_decode_stack_persistent

    stack = mamba2_decode_stack_persistent if fused_recurrent.PERSISTENT else fused_recurrent.mamba2_decode_stack_triton
    return stack(normed, stream, norm_weights, eps, layers, conv_pool, ssm_pool, slot_ids, groups, gated_eps, dt_limits)


def mamba2_mixer_step_applies(
    xbc: torch.Tensor, dt_raw: torch.Tensor, z: torch.Tensor, pool: torch.Tensor, norm_weight: torch.Tensor
) -> bool:
    """Whether :func:`mamba2_mixer_step` runs the CPU op: fp32 or bf16 activations and norm weight of one
    dtype with unit column strides, an fp32 pool with each slot's ``[H, P, N]`` contiguous, no gradients."""
    if pool.dim() != 4 or any(t.dim() != 2 for t in (xbc, dt_raw, z)):
        return False
    head_dim, d_state = pool.shape[2:]
    return (
        z.dtype in (torch.float32, torch.bfloat16)
        and all(t.dtype == z.dtype for t in (xbc, dt_raw, norm_weight))
        and all(t.stride(1) == 1 for t in (xbc, dt_raw, z))
        and pool.dtype == torch.float32
        and pool.stride(3) == 1
        and pool.stride(2) == d_state
        and pool.stride(1) == head_dim * d_state
        and not torch.is_grad_enabled()
        and use_cpu_kernel(z)
    )


def mamba2_mixer_step(
    xbc: torch.Tensor,
    dt_raw: torch.Tensor,
    z: torch.Tensor,
    pool: torch.Tensor,
    slot_ids: torch.Tensor,
    dt_bias: torch.Tensor,
    A_log: torch.Tensor,
    D: torch.Tensor,
    norm_weight: torch.Tensor,
    groups: int,
    eps: float,
    dt_min: float,
    dt_max: float,
) -> torch.Tensor:
    """``xbc [B, d_inner + 2 G N]`` (after the conv, before SiLU), ``dt_raw [B, H]`` and ``z [B, d_inner]``
    (slices of in_proj's output), ``pool [S, H, P, N]`` fp32 updated in place at ``slot_ids [B]``; returns the
    gated, normalised ``[B, d_inner]`` in ``z``'s dtype. The CPU op where :func:`mamba2_mixer_step_applies`,
    else the reference."""
    args = (xbc, dt_raw, z, pool, slot_ids, dt_bias, A_log, D, norm_weight, groups, eps, dt_min, dt_max)
    if mamba2_mixer_step_applies(xbc, dt_raw, z, pool, norm_weight):
        return torch.ops.rnnserve.mamba2_mixer_step(*args[:4], slot_ids.long().contiguous(), *args[5:])
    return mamba2_mixer_step_ref(*args)


__all__ = [
    "STACK_ENABLED",
    "STACK_MAX_BATCH",
    "mamba2_decode_stack",
    "mamba2_decode_triton_applies",
    "mamba2_mixer_step",
    "mamba2_mixer_step_applies",
]
