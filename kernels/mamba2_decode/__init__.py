"""The middle of a Mamba-2 mixer decode step: SiLU on ``xBC``, ``dt`` discretisation, the SSD state update in
the pool, and the gated per-group RMSNorm (everything between the conv update and ``out_proj``).

``naive.py`` is the reference. ``mamba2_decode_cpu.cpp`` runs it as one CPU op (calling the SSD state update's
CPU kernel) instead of about 30 PyTorch ops per layer. Off CPU, and for layouts the op does not take, the model
runs its op-by-op step, which reaches the Triton SSD kernel on a GPU.
"""

from __future__ import annotations

import torch

from rnnserve.kernels.cpu_extension import use_cpu_kernel
from rnnserve.kernels.mamba2_decode.naive import mamba2_mixer_step_ref


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


__all__ = ["mamba2_mixer_step", "mamba2_mixer_step_applies"]
