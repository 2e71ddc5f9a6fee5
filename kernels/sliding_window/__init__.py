"""Causal sliding-window softmax attention whose per-slot state is a ring of the last ``W`` keys and values.

A query at position ``p`` sees positions ``p - W .. p``. ``naive.py`` is the PyTorch reference (queries in
blocks, memory linear in the length); ``torch_varlen.py`` the prefill and decode step off Triton (fused SDPA
calls; the decode step reads each ring once for all the query heads it serves); ``sliding_window_cpu.cpp`` the
decode step on CPU, reading each ring where it lies in the pool; ``chunk.py`` the Triton varlen
prefill (online softmax over the ring and the chunk's keys, then the ring rewritten with the last ``W`` keys)
and ``fused_recurrent.py`` the Triton decode step over the ring.
"""

from __future__ import annotations

import torch

from rnnserve.kernels.backend import use_triton
from rnnserve.kernels.cpu_extension import use_cpu_kernel
from rnnserve.kernels.sliding_window.torch_varlen import sliding_window_decode_sdpa, sliding_window_prefill_sdpa


def sliding_window_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    starts: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Packed ``q [T, H, d]``, ``k, v [T, Hkv, d]``; ``starts [B]`` each chunk's first position; the rings
    ``k_cache, v_cache [B, W, Hkv, d]`` are continued and updated in place. Returns fp32 ``[T, H, d]``."""
    check_head_groups(q.shape[1], k.shape[1])
    if use_triton(q):
        from rnnserve.kernels.sliding_window.chunk import sliding_window_prefill_triton

        return sliding_window_prefill_triton(q, k, v, cu_seqlens, starts, k_cache, v_cache, scale)
    return sliding_window_prefill_sdpa(q, k, v, cu_seqlens, starts, k_cache, v_cache, scale)


def sliding_window_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slot_ids: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One token per sequence (``q [B, H, d]``, ``k, v [B, Hkv, d]`` at ``positions [B]``) over the rings of rows
    ``slot_ids`` of ``k_pool, v_pool [N, W, Hkv, d]``, which take the token's key/value in place. Returns fp32
    ``[B, H, d]``."""
    check_head_groups(q.shape[1], k.shape[1])
    if use_triton(q):
        from rnnserve.kernels.sliding_window.fused_recurrent import sliding_window_decode_triton

        return sliding_window_decode_triton(q, k, v, positions, k_pool, v_pool, slot_ids, scale)
    if use_cpu_kernel(q) and _rings_contiguous(k_pool, v_pool):
        return torch.ops.rnnserve.sliding_window_decode(q, k, v, positions, k_pool, v_pool, slot_ids, scale)
    return sliding_window_decode_sdpa(q, k, v, positions, k_pool, v_pool, slot_ids, scale)


def check_head_groups(heads: int, kv_heads: int) -> None:
    """Query heads share key/value heads in equal groups; any other count would read past the rings."""
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"{heads} query heads cannot share {kv_heads} key/value heads in equal groups")


def _rings_contiguous(k_pool: torch.Tensor, v_pool: torch.Tensor) -> bool:
    """The C++ decode step reads each slot's ring ``[W, Hkv, d]`` as one contiguous block (a pool's layer view)."""
    kv_heads, dim = k_pool.shape[2:]
    return k_pool.stride() == v_pool.stride() and k_pool.stride()[1:] == (kv_heads * dim, dim, 1)


__all__ = ["sliding_window_decode", "sliding_window_prefill"]
