"""The prefill off Triton (CPU): the reference's walk over rings and query blocks, each block's attention one
fused SDPA call instead of two einsums and a masked softmax."""

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
