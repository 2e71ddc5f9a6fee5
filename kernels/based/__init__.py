"""Based's Taylor linear attention: ``phi(q) . phi(k) = 1 + s + s^2/2`` with ``s = scale * q . k``, normalised.

``naive.py`` holds the references (feature map, quadratic form, token loop, decode step); ``torch_chunked.py``
and ``torch_recurrent.py`` the PyTorch paths used on CPU, ``based_cpu.cpp`` the CPU decode step (one pass over
each state, the feature maps from the caller); ``chunk.py`` the Triton chunked varlen prefill and
``fused_recurrent.py`` the Triton decode step, both with the feature map computed in registers (``phi(q)``,
``phi(k)`` never reach memory). States per head: ``S [D, d]`` and ``z [D]`` in fp32, ``D = 1 + f + f^2``.
"""

from __future__ import annotations

import torch

from rnnserve.kernels.backend import use_triton
from rnnserve.kernels.based.naive import taylor_features
from rnnserve.kernels.based.torch_chunked import based_chunked_torch
from rnnserve.kernels.based.torch_recurrent import based_step_torch
from rnnserve.kernels.cpu_extension import use_cpu_kernel


def based_linear_attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    initial_state: tuple[torch.Tensor, torch.Tensor] | None,
    scale: float,
    eps: float,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed ``q, k [T, H, f]``, ``v [T, H, d]`` continuing ``initial_state = (S [B, H, D, d], z [B, H, D])``
    (zeros when ``None``) -> ``(o [T, H, d] fp32, S_final, z_final)``. ``chunk_size`` is the PyTorch path's chunk
    (the Triton kernel's is 16)."""
    if use_triton(q):
        from rnnserve.kernels.based.chunk import based_chunk_triton

        return based_chunk_triton(q, k, v, cu_seqlens, initial_state, scale, eps)
    return based_chunked_torch(q, k, v, cu_seqlens, initial_state, scale, eps, chunk_size)


def based_linear_attention_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    s_pool: torch.Tensor,
    z_pool: torch.Tensor,
    slot_ids: torch.Tensor,
    slots: torch.Tensor | slice,
    scale: float,
    eps: float,
) -> torch.Tensor:
    """One decode step, ``q, k [B, H, f]``, ``v [B, H, d]``: pools ``S [N, H, D, d]``, ``z [N, H, D]`` updated in
    place at rows ``slot_ids`` (``slots``: the same rows as a slice when consecutive). Returns fp32 ``[B, H, d]``."""
    if use_triton(q):
        from rnnserve.kernels.based.fused_recurrent import based_step_triton

        return based_step_triton(q, k, v, s_pool, z_pool, slot_ids, scale, eps)
    if use_cpu_kernel(q) and _states_contiguous(s_pool, z_pool):
        phi_q, phi_k = taylor_features(q, scale), taylor_features(k, scale)
        return torch.ops.rnnserve.based_decode_step(phi_q, phi_k, v, s_pool, z_pool, slot_ids, eps)
    return based_step_torch(q, k, v, s_pool, z_pool, slots, scale, eps)


def _states_contiguous(s_pool: torch.Tensor, z_pool: torch.Tensor) -> bool:
    """The C++ step takes fp32 pools whose slots each hold their ``[H, D, d]`` / ``[H, D]`` states contiguously."""
    features, dim = s_pool.shape[2:]
    return (
        s_pool.dtype == z_pool.dtype == torch.float32
        and s_pool.stride()[1:] == (features * dim, dim, 1)
        and z_pool.stride()[1:] == (features, 1)
    )


__all__ = ["based_linear_attention_step", "based_linear_attention_varlen"]
