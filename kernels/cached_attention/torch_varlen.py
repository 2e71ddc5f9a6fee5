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
        # [1, H, rows, D]: ATen's CPU flash-attention kernel takes 4-d inputs only (3-d ones went to the unfused
        # math path: 3x slower for a causal 512-token chunk, 1.9x with a mask, on a Zen 5).
        keys, values = k_cache[None, slot, :, :end].float(), v_cache[None, slot, :, :end].float()
        query = q[None, lo:hi].float().transpose(1, 2)
        if start == 0 or length == 1:  # causal from the start, or one query that sees every row
            y = F.scaled_dot_product_attention(query, keys, values, is_causal=start == 0, scale=scale)
        else:
            visible = torch.arange(end, device=q.device)[None, :] <= torch.arange(start, end, device=q.device)[:, None]
            y = F.scaled_dot_product_attention(query, keys, values, attn_mask=visible, scale=scale)
        out[lo:hi] = y[0].transpose(0, 1)
    return out
