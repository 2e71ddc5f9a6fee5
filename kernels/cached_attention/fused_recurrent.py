"""Triton decode attention over a per-slot key/value cache: one query token per sequence.

One program per (sequence, head) reads its slot id and position from device memory, streams the keys and
values of positions ``0 .. position`` in blocks of ``BN`` rows with an online softmax (fp32), and writes the
head's output. Nothing about the lengths is known on the host, so a CUDA graph can capture it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TILE_ELEMENTS = 2048

@triton.jit
def _cached_decode_attention_kernel(
    q_ptr, k_ptr, v_ptr, slot_ids_ptr, positions_ptr, out_ptr, scale,
    stride_qb, stride_qh, stride_ks, stride_kt, stride_kh, stride_vs, stride_vt, stride_vh, stride_ob, stride_oh,
    D: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
):
    i_b = tl.program_id(0)
    i_h = tl.program_id(1)
    offs_d = tl.arange(0, BD)
    mask_d = offs_d < D
    slot = tl.load(slot_ids_ptr + i_b).to(tl.int64)
    length = tl.load(positions_ptr + i_b).to(tl.int32) + 1
    q = tl.load(q_ptr + i_b * stride_qb + i_h * stride_qh + offs_d, mask=mask_d, other=0.0).to(tl.float32) * scale
    k_base = k_ptr + slot * stride_ks + i_h * stride_kh
    v_base = v_ptr + slot * stride_vs + i_h * stride_vh
    m = tl.full((), float("-inf"), tl.float32)
    denom = tl.zeros((), tl.float32)
    acc = tl.zeros((BD,), tl.float32)
    for start in range(0, length, BN):
        offs_t = start + tl.arange(0, BN)
        mask_t = offs_t < length
        tile_mask = mask_t[:, None] & mask_d[None, :]
        k = tl.load(k_base + offs_t[:, None].to(tl.int64) * stride_kt + offs_d[None, :], mask=tile_mask, other=0.0)
        scores = tl.sum(k.to(tl.float32) * q[None, :], axis=1)
        scores = tl.where(mask_t, scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=0))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new)
        v = tl.load(v_base + offs_t[:, None].to(tl.int64) * stride_vt + offs_d[None, :], mask=tile_mask, other=0.0)
        acc = acc * alpha + tl.sum(p[:, None] * v.to(tl.float32), axis=0)
        denom = denom * alpha + tl.sum(p, axis=0)
        m = m_new
    tl.store(out_ptr + i_b * stride_ob + i_h * stride_oh + offs_d, acc / denom, mask=mask_d)


def cached_decode_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_ids: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """``q [B, H, D]`` over ``k_cache, v_cache [N, H, L, D]`` (head dim contiguous) -> fp32 ``[B, H, D]``.

    Key tiles of ``2048 / D`` rows (32 for head dim 64) keep the kernel within 96 registers on sm_90."""
    batch, heads, dim = q.shape
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("the caches must be contiguous along the head dimension")
    q = q.contiguous()
    out = torch.empty(batch, heads, dim, dtype=torch.float32, device=q.device)
    block_d = triton.next_power_of_2(dim)
    _cached_decode_attention_kernel[(batch, heads)](
        q, k_cache, v_cache, slot_ids, positions, out, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(2), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(2), v_cache.stride(1), out.stride(0), out.stride(1),
        D=dim, BN=max(16, TILE_ELEMENTS // block_d), BD=block_d,
    )
    return out
