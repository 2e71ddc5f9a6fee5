"""Sliding-window attention off Triton (CPU) through fused SDPA calls instead of einsums and a masked softmax.

Both walk the rings as the reference does and hand it a fused attention: the prefill one SDPA call per query
block, the decode step one call whose query rows for a key/value head are its ``H / Hkv`` query heads, so the
ring is not copied to every query head (the reference's copies: 134 MB a layer for griffin-100m at batch 32, one
key/value head for eight query heads and a 1023-row ring, 1 s a step)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rnnserve.kernels.sliding_window.naive import sliding_window_decode_naive, sliding_window_prefill_naive


def attend_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """``q [Lq, H, d]``, ``k, v [Lk, Hkv, d]``, ``mask [Lq, Lk]`` (every query sees at least itself) -> fp32
    ``[Lq, H, d]``. The inputs go in as ``[1, heads, rows, d]``: ATen's CPU flash-attention kernel takes 4-d
    inputs only."""
    group = q.shape[1] // k.shape[1]
    query = q.float().transpose(0, 1)[None]
    keys = k.float().repeat_interleave(group, 1).transpose(0, 1)[None]
    values = v.float().repeat_interleave(group, 1).transpose(0, 1)[None]
    return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale)[0].transpose(0, 1)


def sliding_window_prefill_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    starts: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Same contract as :func:`~rnnserve.kernels.sliding_window.naive.sliding_window_prefill_naive`."""
    return sliding_window_prefill_naive(q, k, v, cu_seqlens, starts, k_cache, v_cache, scale, attend=attend_sdpa)


def attend_ring_sdpa(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """``q [B, H, d]`` over ``keys, values [B, W + 1, Hkv, d]`` (fp32) where ``mask [B, W + 1]`` -> fp32 ``[B, H,
    d]``: the ``H / Hkv`` query heads of a key/value head are that head's query rows (head ``h = kv * (H / Hkv) +
    g``), so the ring is not copied per query head."""
    batch, heads, dim = q.shape
    kv_heads = keys.shape[2]
    query = q.float().reshape(batch, kv_heads, heads // kv_heads, dim)
    out = F.scaled_dot_product_attention(
        query, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask[:, None, None], scale=scale
    )
    return out.reshape(batch, heads, dim)


def sliding_window_decode_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slot_ids: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Same contract as :func:`~rnnserve.kernels.sliding_window.naive.sliding_window_decode_naive`."""
    return sliding_window_decode_naive(q, k, v, positions, k_pool, v_pool, slot_ids, scale, attend=attend_ring_sdpa)
