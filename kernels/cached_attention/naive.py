"""PyTorch reference: softmax attention of query rows over a per-slot key/value cache addressed by position.

A cache is a pool ``[N, H, L, D]`` (a strided view such as ``pool[:, loop]`` is fine): slot ``s`` holds, per
head, the keys (or values) of its sequence's positions ``0 .. L-1``. Query row ``r`` belongs to slot ``row_slots[r]``
and sits at position ``row_positions[r]``; it attends causally to that slot's positions ``0 ..
row_positions[r]``. Computed in fp32; nothing depends on the data's values on the host (no synchronisation).
"""

from __future__ import annotations

import torch


def cached_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    row_slots: torch.Tensor,
    row_positions: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """``q [R, H, D]`` over rows ``row_slots`` of ``k_cache, v_cache [N, H, L, D]`` -> fp32 ``[R, H, D]``."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    keys = k_cache[row_slots].float()  # [R, H, L, D]
    values = v_cache[row_slots].float()
    visible = torch.arange(k_cache.shape[2], device=q.device)[None, :] <= row_positions[:, None]  # [R, L]
    scores = torch.einsum("rhd,rhld->rhl", q.float(), keys) * scale
    probs = torch.softmax(scores.masked_fill(~visible[:, None, :], float("-inf")), dim=-1)
    values = values.masked_fill(~visible[:, None, :, None], 0.0)  # rows past the position may hold anything
    return torch.einsum("rhl,rhld->rhd", probs, values)
