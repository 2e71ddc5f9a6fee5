"""SDPA over the slot cache, one call per sequence: packed prefill chunks, and the decode step on CPU.

Each sequence reads its slot's rows ``0 .. end`` as views of the head-major cache (no gather), so the cost
follows the sequences' own lengths rather than the cache's capacity or the batch's longest sequence. Slots and
positions are read on the host once per call.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F


def cached_attention_varlen_sdpa(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: Sequence[int],
    starts: Sequence[int],
    lengths: Sequence[int],
    scale: float,
) -> torch.Tensor:
    """Chunk ``i`` of the packed ``q [T, H, D]`` holds positions ``starts[i] ..`` of slot ``slots[i]`` of the
    caches ``[N, H, L, D]``; each query attends causally to its slot up to its own position. fp32 ``[T, H, D]``."""
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    hi = 0
    for slot, start, length in zip(slots, starts, lengths, strict=True):
        lo, hi = hi, hi + length
        end = start + length
        keys, values = k_cache[slot, :, :end].float(), v_cache[slot, :, :end].float()  # [H, end, D]
        query = q[lo:hi].float().transpose(0, 1)  # [H, length, D]
        if start == 0 or length == 1:  # causal from the start, or one query that sees every row
            y = F.scaled_dot_product_attention(query, keys, values, is_causal=start == 0, scale=scale)
        else:
            visible = torch.arange(end, device=q.device)[None, :] <= torch.arange(start, end, device=q.device)[:, None]
            y = F.scaled_dot_product_attention(query, keys, values, attn_mask=visible, scale=scale)
        out[lo:hi] = y.transpose(0, 1)
    return out
