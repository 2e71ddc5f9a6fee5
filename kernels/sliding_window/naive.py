"""Reference for causal sliding-window softmax attention over a per-slot ring buffer (the test oracle).

A query at position ``p`` attends to the keys at positions ``p - W .. p`` (``W + 1`` keys, its own included;
Based's ``window_size // 2 = W``). Each sequence's state is a ring ``[W, Hkv, d]`` of the ``W`` keys (and
values) before the current token: position ``p`` lives in row ``p mod W``. Query head ``h`` reads key/value
head ``h // (H / Hkv)``. Scores, softmax and the output are fp32.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

QUERY_BLOCK = 256
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """``q [Lq, H, d]``, ``k, v [Lk, Hkv, d]``, ``mask [Lq, Lk]`` -> fp32 ``[Lq, H, d]``."""
    group = q.shape[1] // k.shape[1]
    k, v = k.float().repeat_interleave(group, 1), v.float().repeat_interleave(group, 1)
    scores = torch.einsum("ihd,jhd->hij", q.float(), k) * scale
    weights = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return torch.einsum("hij,jhd->ihd", weights, v)


def sliding_window_prefill_naive(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    starts: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scale: float,
    attend: Attend = _attend,
) -> torch.Tensor:
    """Packed chunks ``q [T, H, d]``, ``k, v [T, Hkv, d]``; sequence ``b`` starts at position ``starts[b]`` and
    continues its ring ``k_cache[b], v_cache[b] [W, Hkv, d]``, which ends holding its last ``W`` keys/values
    (updated in place). Queries are taken in blocks of 256 so memory stays linear in the length, each with the
    keys it can see (a prompt's first block: its own 256, not the ring's W empty rows too); ``attend`` computes a
    block's attention (the CPU path passes a fused one)."""
    window = k_cache.shape[1]
    out = torch.empty(q.shape[0], q.shape[1], v.shape[2], dtype=torch.float32, device=q.device)
    bounds, first_positions = cu_seqlens.tolist(), starts.tolist()
    for b, start in enumerate(first_positions):
        lo, hi = bounds[b], bounds[b + 1]
        key_pos = torch.arange(start - window, start + hi - lo, device=q.device)  # ring rows, then the chunk
        rows = key_pos[:window] % window
        keys = torch.cat([k_cache[b, rows].float(), k[lo:hi].float()])
        values = torch.cat([v_cache[b, rows].float(), v[lo:hi].float()])
        for a in range(0, hi - lo, QUERY_BLOCK):
            e = min(a + QUERY_BLOCK, hi - lo)
            first = max(a, window - start)  # the block's first key; ring rows before position 0 hold nothing
            query_pos = key_pos[window + a : window + e, None]
            near = key_pos[None, first : window + e]
            mask = (near >= 0) & (near <= query_pos) & (near >= query_pos - window)
            near_keys, near_values = keys[first : window + e], values[first : window + e]
            out[lo + a : lo + e] = attend(q[lo + a : lo + e], near_keys, near_values, mask, scale)
        k_cache[b, key_pos[-window:] % window] = keys[-window:].to(k_cache.dtype)
        v_cache[b, key_pos[-window:] % window] = values[-window:].to(v_cache.dtype)
    return out


def _attend_ring(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """``q [B, H, d]`` over ``keys, values [B, W + 1, Hkv, d]`` (fp32: the ring, then the token) where ``mask [B,
    W + 1]`` -> fp32 ``[B, H, d]``."""
    group = q.shape[1] // keys.shape[2]
    keys, values = keys.repeat_interleave(group, 2), values.repeat_interleave(group, 2)
    scores = torch.einsum("bhd,bjhd->bhj", q.float(), keys) * scale
    weights = torch.softmax(scores.masked_fill(~mask[:, None], float("-inf")), dim=-1)
    return torch.einsum("bhj,bjhd->bhd", weights, values)


def sliding_window_decode_naive(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slot_ids: torch.Tensor,
    scale: float,
    attend: Attend = _attend_ring,
) -> torch.Tensor:
    """One token per sequence at ``positions [B]``: attend over the ring of rows ``slot_ids`` of ``k_pool, v_pool
    [N, W, Hkv, d]`` plus the token itself, then store its key/value at ring row ``position mod W`` (in place).
    Returns fp32 ``[B, H, d]``; ``attend`` computes the attention (the path off Triton passes a fused one)."""
    window = k_pool.shape[1]
    rows = torch.arange(window, device=q.device)
    ring_pos = positions[:, None] - 1 - (positions[:, None] - 1 - rows) % window  # latest position < p per row
    keys = torch.cat([k_pool[slot_ids].float(), k[:, None].float()], dim=1)
    values = torch.cat([v_pool[slot_ids].float(), v[:, None].float()], dim=1)
    mask = torch.cat([ring_pos >= 0, torch.ones_like(positions[:, None], dtype=torch.bool)], dim=1)
    out = attend(q, keys, values, mask, scale)
    k_pool[slot_ids, positions % window] = k.to(k_pool.dtype)
    v_pool[slot_ids, positions % window] = v.to(v_pool.dtype)
    return out
