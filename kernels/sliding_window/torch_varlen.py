"""Sliding-window attention off Triton (CPU) through fused SDPA calls instead of einsums and a masked softmax.

The prefill walks rings and query blocks as the reference does, each block's attention one SDPA call. The
decode step takes each sequence's ``H / Hkv`` query heads of a key/value head as that head's query rows, so the
ring is read as stored (the reference copied it to every query head: 134 MB a layer for griffin-100m at batch
32, one key/value head for eight query heads and a 1023-row ring, 1 s a step)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rnnserve.kernels.sliding_window.naive import sliding_window_prefill_naive


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
    batch, heads, dim = q.shape
    kv_heads, window = k.shape[1], k_pool.shape[1]
    rows = torch.arange(window, device=q.device)
    ring_pos = positions[:, None] - 1 - (positions[:, None] - 1 - rows) % window  # latest position < p per row
    visible = torch.cat([ring_pos >= 0, torch.ones_like(positions[:, None], dtype=torch.bool)], dim=1)
    keys = torch.cat([k_pool[slot_ids].float(), k[:, None].float()], dim=1).transpose(1, 2)  # [B, Hkv, W + 1, d]
    values = torch.cat([v_pool[slot_ids].float(), v[:, None].float()], dim=1).transpose(1, 2)
    query = q.float().reshape(batch, kv_heads, heads // kv_heads, dim)  # head h = kv * (H / Hkv) + g
    out = F.scaled_dot_product_attention(query, keys, values, attn_mask=visible[:, None, None], scale=scale)
    k_pool[slot_ids, positions % window] = k.to(k_pool.dtype)
    v_pool[slot_ids, positions % window] = v.to(v_pool.dtype)
    return out.reshape(batch, heads, dim)
