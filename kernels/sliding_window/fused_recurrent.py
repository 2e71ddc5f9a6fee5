"""Triton decode step of sliding-window attention over a per-slot ring.

One program per (sequence, key/value head): for each of the ``GROUP`` query heads sharing it, an online softmax
(fp32) over the token's own key and the ring's ``W`` keys in blocks of ``BW`` rows; then, after a barrier (every
thread has read the ring before the row is overwritten), the token's key and value go to ring row
``position mod W``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _sw_decode_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, kp_ptr, vp_ptr, positions_ptr, slot_ids_ptr,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh, stride_ob, stride_oh,
    stride_pn, stride_pw, stride_ph, window, head_dim, scale,
    GROUP: tl.constexpr, BW: tl.constexpr, BD: tl.constexpr,
):
    i_b = tl.program_id(0)
    i_kv = tl.program_id(1)
    slot = tl.load(slot_ids_ptr + i_b).to(tl.int64)
    pos = tl.load(positions_ptr + i_b).to(tl.int64)
    offs_d = tl.arange(0, BD)
    mask_d = offs_d < head_dim
    ring_head = slot * stride_pn + i_kv * stride_ph
    k = tl.load(k_ptr + i_b * stride_kb + i_kv * stride_kh + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + i_b * stride_vb + i_kv * stride_vh + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    for g in range(GROUP):
        i_h = i_kv * GROUP + g
        q = tl.load(q_ptr + i_b * stride_qb + i_h * stride_qh + offs_d, mask=mask_d, other=0.0).to(tl.float32)
        # Online softmax, starting from the token's own key; the ring in blocks of BW rows.
        m = tl.sum(q * k, axis=0) * scale
        l = tl.full([], 1.0, dtype=tl.float32)
        acc = v
        for r0 in range(0, window, BW):
            rows = r0 + tl.arange(0, BW)
            ring_pos = pos - 1 - (pos - 1 - rows + window) % window  # the latest position before pos per row
            valid = (rows < window) & (ring_pos >= 0)
            ring = ring_head + rows[:, None] * stride_pw + offs_d[None, :]
            mask = valid[:, None] & mask_d[None, :]
            keys = tl.load(kp_ptr + ring, mask=mask, other=0.0).to(tl.float32)
            values = tl.load(vp_ptr + ring, mask=mask, other=0.0).to(tl.float32)
            s = tl.where(valid, tl.sum(q[None, :] * keys, axis=1) * scale, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=0))
            p = tl.exp(s - m_new)
            alpha = tl.exp(m - m_new)
            l = l * alpha + tl.sum(p, axis=0)
            acc = acc * alpha + tl.sum(p[:, None] * values, axis=0)
            m = m_new
        tl.store(o_ptr + i_b * stride_ob + i_h * stride_oh + offs_d, acc / l, mask=mask_d)
    tl.debug_barrier()
    row = ring_head + (pos % window) * stride_pw + offs_d
    tl.store(kp_ptr + row, k.to(kp_ptr.dtype.element_ty), mask=mask_d)
    tl.store(vp_ptr + row, v.to(vp_ptr.dtype.element_ty), mask=mask_d)


def sliding_window_decode_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slot_ids: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Same contract as :func:`rnnserve.kernels.sliding_window.sliding_window_decode`."""
    batch, heads, head_dim = q.shape
    kv_heads, window = k.shape[1], k_pool.shape[1]
    if k_pool.stride() != v_pool.stride() or k_pool.stride(3) != 1:
        raise ValueError("k_pool and v_pool must share one layout with a contiguous last dimension")
    q, k, v = (t if t.stride(2) == 1 else t.contiguous() for t in (q, k, v))
    out = torch.empty(batch, heads, head_dim, dtype=torch.float32, device=q.device)
    block_d = triton.next_power_of_2(head_dim)
    block_w = min(32, triton.next_power_of_2(window))
    _sw_decode_kernel[(batch, kv_heads)](
        q, k, v, out, k_pool, v_pool, positions, slot_ids,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        k_pool.stride(0), k_pool.stride(1), k_pool.stride(2), window, head_dim, scale,
        GROUP=heads // kv_heads, BW=block_w, BD=block_d, num_warps=4,
    )
    return out
