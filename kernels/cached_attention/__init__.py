"""Softmax attention over a per-slot key/value cache addressed by position (the looped transformers' K/V).

A cache pool ``[N, H, L, D]`` (head-major) holds, for each slot and head, the keys (or values) of positions
``0 .. L-1`` of its sequence; the functions first write the new tokens' keys and values at their positions (in
place), then attend causally. ``naive.py`` is the reference; ``fused_recurrent.py`` the Triton decode kernel
(CUDA, graph capturable); ``cached_attention_cpu.cpp`` the CPU decode step (each row's cache prefix read where it
lies, one pass over keys and one over values); ``torch_varlen.py`` the per-sequence SDPA path (prefill
everywhere, decode on CPU without the fused kernels).
Decode elsewhere (no Triton, e.g. the meta device) runs the reference, which reads no values on the host.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rnnserve.kernels.backend import use_triton
from rnnserve.kernels.cached_attention.naive import cached_attention_ref
from rnnserve.kernels.cached_attention.torch_varlen import cached_attention_varlen_sdpa
from rnnserve.kernels.cpu_extension import use_cpu_kernel


def cached_attention_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: Sequence[int],
    starts: Sequence[int],
    lengths: Sequence[int],
    scale: float | None = None,
) -> torch.Tensor:
    """Packed chunks ``q, k, v [T, H, D]``: chunk ``i`` (``lengths[i]`` rows) continues slot ``slots[i]`` at
    position ``starts[i]`` (all three on the host). Stores its keys and values in the caches, then attends.
    Returns fp32 ``[T, H, D]``."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    hi = 0
    for slot, start, length in zip(slots, starts, lengths, strict=True):
        lo, hi = hi, hi + length
        k_cache[slot, :, start : start + length] = k[lo:hi].transpose(0, 1).to(k_cache.dtype)
        v_cache[slot, :, start : start + length] = v[lo:hi].transpose(0, 1).to(v_cache.dtype)
    return cached_attention_varlen_sdpa(q, k_cache, v_cache, slots, starts, lengths, scale)


def cached_attention_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_ids: torch.Tensor,
    positions: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """One token per sequence: ``q, k, v [B, H, D]`` at ``positions [B]`` of slots ``slot_ids [B]``. Stores
    ``k, v`` in the caches, then attends; no host synchronisation off CPU. Returns fp32 ``[B, H, D]``.

    Positions must lie in ``0 .. L-1``: the CPU kernel rejects others, while off CPU, where checking would
    synchronise, a position of -1 would store at row ``L-1`` and attend to no key (NaN). A batch padded to a
    CUDA graph's size pads with the state pool's scratch slot at positions of 0 or more instead."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if use_cpu_kernel(q):  # stores k and v itself
        return torch.ops.rnnserve.cached_attention_decode(q, k, v, k_cache, v_cache, slot_ids, positions, scale)
    k_cache[slot_ids, :, positions] = k.to(k_cache.dtype)
    v_cache[slot_ids, :, positions] = v.to(v_cache.dtype)
    if use_triton(q):
        from rnnserve.kernels.cached_attention.fused_recurrent import cached_decode_attention_triton

        return cached_decode_attention_triton(q, k_cache, v_cache, slot_ids, positions, scale)
    if q.device.type == "cpu":
        ones = [1] * q.shape[0]
        return cached_attention_varlen_sdpa(q, k_cache, v_cache, slot_ids.tolist(), positions.tolist(), ones, scale)
    return cached_attention_ref(q, k_cache, v_cache, slot_ids, positions, scale)


__all__ = ["cached_attention_decode", "cached_attention_prefill"]
