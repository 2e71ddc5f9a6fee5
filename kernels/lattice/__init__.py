"""Lattice's orthogonal state recurrence (DEC / ENC / SIM, unit-sphere normalisation, optional forget gate).

``naive.py`` is the step-by-step PyTorch reference (the test oracle; batched over sequences and heads, one
token per step); ``fused_recurrent.py`` holds the Triton kernels, a fused sequential varlen prefill (the
recurrence has no parallel form) and a fused decode step; ``lattice_cpu.cpp`` the fused C++ kernel for both
on CPU (see :mod:`rnnserve.kernels.cpu_extension`; the reference runs when it is unavailable). Both functions
read each sequence's initial state from its slot of a fp32 state pool ``[N, H, d, m]`` and write the final
state back in place.
"""

from __future__ import annotations

import torch

from rnnserve.kernels.backend import use_triton
from rnnserve.kernels.cpu_extension import use_cpu_kernel
from rnnserve.kernels.lattice.naive import VARIANTS, lattice_decode_ref, lattice_step_ref, lattice_varlen_ref


def _cpu_scan(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gamma: torch.Tensor,
    mu: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    state: torch.Tensor,
    slot_ids: torch.Tensor,
    variant: str,
    normalize: bool,
) -> torch.Tensor:
    def f32(x: torch.Tensor) -> torch.Tensor:
        return x.float().contiguous()

    return torch.ops.rnnserve.lattice_scan(
        f32(q), f32(k), f32(v), f32(gamma), None if mu is None else f32(mu),
        None if cu_seqlens is None else cu_seqlens.long().contiguous(), state, slot_ids.long().contiguous(),
        VARIANTS.index(variant), normalize,
    )


def _fused_cpu(q: torch.Tensor, state: torch.Tensor) -> bool:
    return state.dtype == torch.float32 and use_cpu_kernel(q)


def lattice_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gamma: torch.Tensor,
    mu: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    state: torch.Tensor,
    slot_ids: torch.Tensor,
    variant: str,
    normalize: bool = True,
) -> torch.Tensor:
    """Prefill packed ``q, k [T, H, m]``, ``v [T, H, d]``, ``gamma, mu [T, H]`` (``mu`` None: no forget gate)
    -> ``y [T, H, d]`` fp32. Rows ``slot_ids`` of the fp32 pool ``state [N, H, d, m]`` are the initial states
    and receive the final states."""
    if use_triton(q):
        from rnnserve.kernels.lattice.fused_recurrent import lattice_varlen_triton

        return lattice_varlen_triton(q, k, v, gamma, mu, cu_seqlens, state, slot_ids, variant, normalize)
    if _fused_cpu(q, state):
        return _cpu_scan(q, k, v, gamma, mu, cu_seqlens, state, slot_ids, variant, normalize)
    return lattice_varlen_ref(q, k, v, gamma, mu, cu_seqlens, state, slot_ids, variant, normalize)


def lattice_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gamma: torch.Tensor,
    mu: torch.Tensor | None,
    state: torch.Tensor,
    slot_ids: torch.Tensor,
    variant: str,
    normalize: bool = True,
) -> torch.Tensor:
    """One token per sequence, ``q, k [B, H, m]``, ``v [B, H, d]``, ``gamma, mu [B, H]`` -> ``y [B, H, d]``
    fp32; rows ``slot_ids`` of ``state [N, H, d, m]`` are updated in place."""
    if use_triton(q):
        from rnnserve.kernels.lattice.fused_recurrent import lattice_decode_triton

        return lattice_decode_triton(q, k, v, gamma, mu, state, slot_ids, variant, normalize)
    if _fused_cpu(q, state):
        return _cpu_scan(q, k, v, gamma, mu, None, state, slot_ids, variant, normalize)
    return lattice_decode_ref(q, k, v, gamma, mu, state, slot_ids, variant, normalize)


__all__ = ["VARIANTS", "lattice_decode", "lattice_step_ref", "lattice_varlen"]
