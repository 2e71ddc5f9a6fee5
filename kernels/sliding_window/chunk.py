"""Triton varlen prefill of sliding-window attention over a per-slot ring, then the ring rewritten.

``_sw_prefill_kernel``: one program per (sequence, query head, block of ``BQ`` queries). A sequence's keys are
seen as one row ``[ring (W keys before the chunk, by position), chunk keys]``; a query block needs the slice
starting at its own first index, ``W + BQ`` keys long, walked in blocks of ``BK`` with an online softmax (fp32):
first the part in the ring (row ``position mod W``), then the part in the chunk, each loop with one address
per element. ``_ring_write_kernel`` then stores each sequence's
last ``W`` keys and values in their rows (a second launch, so no program overwrites a row another still reads).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _online_softmax_block(q, k, v, visible, m_i, l_i, acc, scale, PRECISION: tl.constexpr):
    """One key block of the online softmax: ``visible [BQ, BK]``; returns the updated ``m_i, l_i, acc``."""
    s = tl.where(visible, tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i * alpha + tl.sum(p, axis=1), acc


@triton.jit
def _sw_prefill_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, kc_ptr, vc_ptr, cu_seqlens_ptr, starts_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_cb, stride_cw, stride_ch, window, head_dim, scale,
    GROUP: tl.constexpr, BQ: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr,
    DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
):
    i_b = tl.program_id(0)
    i_h = tl.program_id(1)
    q_lo = tl.program_id(2) * BQ
    bos = tl.load(cu_seqlens_ptr + i_b).to(tl.int32)
    length = tl.load(cu_seqlens_ptr + i_b + 1).to(tl.int32) - bos
    if q_lo < length:
        start = tl.load(starts_ptr + i_b).to(tl.int32)
        i_kv = i_h // GROUP
        offs_d = tl.arange(0, BD)
        mask_d = offs_d < head_dim
        idx_q = q_lo + tl.arange(0, BQ)
        mask_q = idx_q < length
        q = tl.load(q_ptr + (bos + idx_q)[:, None] * stride_qt + i_h * stride_qh + offs_d[None, :],
                    mask=mask_q[:, None] & mask_d[None, :], other=0.0).to(DOT_DTYPE)
        pos_q = (start + idx_q)[:, None]
        m_i = tl.full([BQ], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BQ], dtype=tl.float32)
        acc = tl.zeros([BQ, BD], dtype=tl.float32)
        # Keys are indexed as one row [ring, chunk]: index j holds position start - W + j. Query index i needs
        # j in [i, i + W]. First the ring part (j < W, from ring row position mod W), then the chunk's keys.
        for j0 in range(q_lo, window, BK):
            idx_k = j0 + tl.arange(0, BK)
            pos_k = start - window + idx_k
            valid = (idx_k < window) & (pos_k >= 0)
            ring = i_b * stride_cb + ((pos_k + window) % window) * stride_cw + i_kv * stride_ch
            mask = valid[:, None] & mask_d[None, :]
            k = tl.load(kc_ptr + ring[:, None] + offs_d[None, :], mask=mask, other=0.0).to(DOT_DTYPE)
            v = tl.load(vc_ptr + ring[:, None] + offs_d[None, :], mask=mask, other=0.0).to(DOT_DTYPE)
            visible = valid[None, :] & (pos_k[None, :] >= pos_q - window)
            m_i, l_i, acc = _online_softmax_block(q, k, v, visible, m_i, l_i, acc, scale, PRECISION)
        for c0 in range(tl.maximum(q_lo - window, 0), tl.minimum(q_lo + BQ, length), BK):
            idx_c = c0 + tl.arange(0, BK)  # index within the chunk
            pos_k = start + idx_c
            valid = idx_c < length
            mask = valid[:, None] & mask_d[None, :]
            k = tl.load(k_ptr + (bos + idx_c)[:, None] * stride_kt + i_kv * stride_kh + offs_d[None, :],
                        mask=mask, other=0.0).to(DOT_DTYPE)
            v = tl.load(v_ptr + (bos + idx_c)[:, None] * stride_vt + i_kv * stride_vh + offs_d[None, :],
                        mask=mask, other=0.0).to(DOT_DTYPE)
            visible = valid[None, :] & (pos_k[None, :] <= pos_q) & (pos_k[None, :] >= pos_q - window)
            m_i, l_i, acc = _online_softmax_block(q, k, v, visible, m_i, l_i, acc, scale, PRECISION)
        out = acc / tl.where(mask_q, l_i, 1.0)[:, None]  # rows past the chunk saw no key
        tl.store(o_ptr + (bos + idx_q)[:, None] * stride_ot + i_h * stride_oh + offs_d[None, :], out,
                 mask=mask_q[:, None] & mask_d[None, :])


@triton.jit
def _ring_write_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, cu_seqlens_ptr, starts_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_cb, stride_cw, stride_ch, window, head_dim,
    BW: tl.constexpr, BD: tl.constexpr,
):
    i_b = tl.program_id(0)
    i_h = tl.program_id(1)
    bos = tl.load(cu_seqlens_ptr + i_b).to(tl.int64)
    length = tl.load(cu_seqlens_ptr + i_b + 1).to(tl.int64) - bos
    start = tl.load(starts_ptr + i_b).to(tl.int64)
    last = start + length - 1
    rows = tl.program_id(2) * BW + tl.arange(0, BW)
    offs_d = tl.arange(0, BD)
    pos = last - (last - rows + window) % window  # the chunk's latest position in each ring row
    mask = ((rows < window) & (pos >= start))[:, None] & (offs_d < head_dim)[None, :]  # none for empty chunks
    src = (bos + pos - start)[:, None]
    dst = i_b * stride_cb + rows[:, None] * stride_cw + i_h * stride_ch + offs_d[None, :]
    k = tl.load(k_ptr + src * stride_kt + i_h * stride_kh + offs_d[None, :], mask=mask, other=0.0)
    v = tl.load(v_ptr + src * stride_vt + i_h * stride_vh + offs_d[None, :], mask=mask, other=0.0)
    tl.store(kc_ptr + dst, k.to(kc_ptr.dtype.element_ty), mask=mask)
    tl.store(vc_ptr + dst, v.to(vc_ptr.dtype.element_ty), mask=mask)


def _prefill_warps(block_d: int, dot_dtype: tl.dtype) -> int:
    """16 x 16 query/key tiles fit sm_90's 128 registers without spills with these warp counts."""
    return 16 if block_d > 64 and dot_dtype != tl.float32 else 8


def sliding_window_prefill_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    starts: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Same contract as :func:`rnnserve.kernels.sliding_window.sliding_window_prefill`."""
    total, heads, head_dim = q.shape
    kv_heads, window = k.shape[1], k_cache.shape[1]
    batch = cu_seqlens.numel() - 1
    if k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must share one layout")
    q, k, v = (t if t.stride(2) == 1 else t.contiguous() for t in (q, k, v))
    if k_cache.stride(3) != 1:
        raise ValueError("the rings' last dimension must be contiguous")
    out = torch.empty(total, heads, head_dim, dtype=torch.float32, device=q.device)
    max_len = int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) if batch else 0
    block_d = max(16, triton.next_power_of_2(head_dim))
    # fp32 runs exact fp32 dots (FMA); 16-bit activations feed the tensor cores in their own dtype.
    dot_dtype = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}.get(q.dtype, tl.float32)
    cache_strides = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2))
    if max_len:
        _sw_prefill_kernel[(batch, heads, triton.cdiv(max_len, 16))](
            q, k, v, out, k_cache, v_cache, cu_seqlens, starts,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
            *cache_strides, window, head_dim, scale,
            GROUP=heads // kv_heads, BQ=16, BK=16, BD=block_d, DOT_DTYPE=dot_dtype,
            PRECISION="ieee" if dot_dtype == tl.float32 else "tf32", num_warps=_prefill_warps(block_d, dot_dtype),
        )
        block_w = min(16, triton.next_power_of_2(window))
        _ring_write_kernel[(batch, kv_heads, triton.cdiv(window, block_w))](
            k, v, k_cache, v_cache, cu_seqlens, starts,
            k.stride(0), k.stride(1), v.stride(0), v.stride(1), *cache_strides, window, head_dim,
            BW=block_w, BD=block_d, num_warps=4,
        )
    return out
