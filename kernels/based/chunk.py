"""Triton chunked varlen prefill of Based's Taylor linear attention, the feature map computed in registers.

One program owns one (sequence, head, block of ``BV`` value channels) and walks the sequence in chunks of
``BT`` tokens. The small parts of the state stay in registers: ``S0 [BV]`` (constant feature), ``S1 [F, BV]``
(linear features) and all of ``z`` (``z2`` as an ``[F, F]`` tile); the quadratic block ``S2 [F*F, BV]`` is too
large for registers and is updated in place in the output state, one ``[F, BV]`` slice per feature ``a``. Per
chunk: the causal in-chunk part is the quadratic form ``1 + s + s^2/2``; the
carried state is read against ``phi(q)`` without forming it (``sum_a q_a (q . S2[a])``) and takes ``phi(k)^T v``
the same way. The small products are broadcast-and-sum in fp32 (exact, and lighter on registers than fp32
``tl.dot`` on sm_90 at these 16-wide tiles). Feature dims below 16 are zero-padded to 16; padded rows never
touch memory.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl


@triton.jit
def _mm(a, b):
    """``a [M, K] @ b [K, N]`` in fp32 as a broadcast product and sum (exact; light on registers for K = 16)."""
    return tl.sum(a[:, :, None] * b[None, :, :], axis=1)


@triton.jit
def _mtm(a, b):
    """``a^T @ b`` for ``a [T, I]``, ``b [T, J]``: ``sum_t a[t, i] b[t, j]``, as :func:`_mm`."""
    return tl.sum(a[:, :, None] * b[:, None, :], axis=0)


@triton.jit
def _based_chunk_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, z0_ptr, st_ptr, zt_ptr, cu_seqlens_ptr,
    stride_qt, stride_qh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_sb, stride_sh, stride_sr, stride_zb, stride_zh,
    f, dv, sqrt_scale, quad_scale, scale, eps,
    FP: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr,
):
    i_b = tl.program_id(0)
    i_h = tl.program_id(1)
    i_v = tl.program_id(2)
    bos = tl.load(cu_seqlens_ptr + i_b).to(tl.int64)
    eos = tl.load(cu_seqlens_ptr + i_b + 1).to(tl.int64)
    offs_f = tl.arange(0, FP)
    mask_f = offs_f < f
    mask_ff = mask_f[:, None] & mask_f[None, :]
    offs_v = i_v * BV + tl.arange(0, BV)
    mask_v = offs_v < dv
    mask_fv = mask_f[:, None] & mask_v[None, :]
    # State rows: 0 the constant feature, 1 + a the linear ones, 1 + f + a * f + b the quadratic ones.
    s_head = st_ptr + i_b * stride_sb + i_h * stride_sh
    s0 = tl.load(s_head + offs_v, mask=mask_v, other=0.0)
    s1 = tl.load(s_head + (1 + offs_f)[:, None] * stride_sr + offs_v[None, :], mask=mask_fv, other=0.0)
    z_head = i_b * stride_zb + i_h * stride_zh
    z_rows = 1 + f + offs_f[:, None] * f + offs_f[None, :]
    z0 = tl.load(z0_ptr + z_head)
    z1 = tl.load(z0_ptr + z_head + 1 + offs_f, mask=mask_f, other=0.0)
    z2 = tl.load(z0_ptr + z_head + z_rows, mask=mask_ff, other=0.0)
    offs_t = tl.arange(0, BT)
    causal = offs_t[:, None] >= offs_t[None, :]
    for start in range(bos, eos, BT):
        rows = start + offs_t
        mask_t = rows < eos
        mask_tf = mask_t[:, None] & mask_f[None, :]
        q_rows = q_ptr + rows * stride_qt + i_h * stride_qh
        k_rows = k_ptr + rows * stride_qt + i_h * stride_qh
        q = tl.load(q_rows[:, None] + offs_f[None, :], mask=mask_tf, other=0.0).to(tl.float32)
        k = tl.load(k_rows[:, None] + offs_f[None, :], mask=mask_tf, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + rows[:, None] * stride_vt + i_h * stride_vh + offs_v[None, :],
                    mask=mask_t[:, None] & mask_v[None, :], other=0.0).to(tl.float32)
        # The chunk itself: phi(q_i) . phi(k_j) = 1 + s + s^2 / 2 for j <= i.
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale
        a = tl.where(causal & mask_t[None, :], 1.0 + s + 0.5 * s * s, 0.0)
        # a v over finite values only: a NaN or infinite v_j would give 0 * v_j = NaN in the rows before it (the
        # reference's recurrence never lets a token see a later one). Row i's weights a_ij (j <= i) are positive,
        # so the non-finite values reach it as their running sum (NaN, or the infinities' sum).
        finite = tl.abs(v) < float("inf")
        num = _mm(a, tl.where(finite, v, 0.0)) + tl.cumsum(tl.where(finite, 0.0, v), axis=0)
        num += s0[None, :] + sqrt_scale * _mm(q, s1)
        den = tl.sum(a, axis=1) + z0 + sqrt_scale * tl.sum(q * z1[None, :], axis=1)
        den += quad_scale * tl.sum(_mm(q, z2) * q, axis=1)
        # Quadratic features of the carried state, one block S2[a] = rows (a, 0..f-1) at a time:
        # phi2(q) . S2 = sum_a q_a (q . S2[a]) * quad_scale, and S2[a] += (k_a k)^T v * quad_scale.
        for i_a in range(f):
            ptr_a = s_head + (1 + f + i_a * f + offs_f)[:, None] * stride_sr + offs_v[None, :]
            s2_a = tl.load(ptr_a, mask=mask_fv, other=0.0)
            q_a = tl.load(q_rows + i_a, mask=mask_t, other=0.0).to(tl.float32)
            k_a = tl.load(k_rows + i_a, mask=mask_t, other=0.0).to(tl.float32)
            num += (quad_scale * q_a)[:, None] * _mm(q, s2_a)
            s2_a += _mtm(k * (quad_scale * k_a)[:, None], v)
            tl.store(ptr_a, s2_a, mask=mask_fv)
        tl.store(o_ptr + rows[:, None] * stride_ot + i_h * stride_oh + offs_v[None, :], num / (den + eps)[:, None],
                 mask=mask_t[:, None] & mask_v[None, :])
        s0 += tl.sum(v, axis=0)
        s1 += sqrt_scale * _mtm(k, v)
        z0 += tl.sum(mask_t.to(tl.float32), axis=0)
        z1 += sqrt_scale * tl.sum(k, axis=0)
        z2 += quad_scale * _mtm(k, k)
        # The next chunk reads S2 back, possibly through other threads than those that stored it.
        tl.debug_barrier()
    tl.store(s_head + offs_v, s0, mask=mask_v)
    tl.store(s_head + (1 + offs_f)[:, None] * stride_sr + offs_v[None, :], s1, mask=mask_fv)
    if i_v == 0:
        z_out = zt_ptr + i_b * stride_zb + i_h * stride_zh
        tl.store(z_out, z0)
        tl.store(z_out + 1 + offs_f, z1, mask=mask_f)
        tl.store(z_out + z_rows, z2, mask=mask_ff)


def feature_block(f: int) -> int:
    """The padded feature dimension of the kernels: a power of two, at least 16 (``tl.dot``'s minimum)."""
    return max(16, triton.next_power_of_2(f))


def based_chunk_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    initial_state: tuple[torch.Tensor, torch.Tensor] | None,
    scale: float,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract as :func:`rnnserve.kernels.based.based_linear_attention_varlen`."""
    total, heads, f = q.shape
    dv = v.shape[2]
    batch = cu_seqlens.numel() - 1
    features = 1 + f + f * f
    q, k = q.contiguous(), k.contiguous()
    if v.stride(2) != 1:
        v = v.contiguous()
    out = torch.empty(total, heads, dv, dtype=torch.float32, device=q.device)
    # The kernel updates S in place in s_final (each program owns its value channels) and reads z from z_init.
    if initial_state is not None:
        s_final = initial_state[0].to(torch.float32, copy=True).contiguous()
        z_init = initial_state[1].float().contiguous()
    else:
        s_final = torch.zeros(batch, heads, features, dv, dtype=torch.float32, device=q.device)
        z_init = torch.zeros(batch, heads, features, dtype=torch.float32, device=q.device)
    z_final = torch.empty_like(z_init)
    block_v = min(16, triton.next_power_of_2(dv))  # 16 x 16 tiles: under 100 registers on sm_90, no spills
    _based_chunk_kernel[(batch, heads, triton.cdiv(dv, block_v))](
        q, k, v, out, z_init, s_final, z_final, cu_seqlens,
        q.stride(0), q.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        s_final.stride(0), s_final.stride(1), s_final.stride(2), z_final.stride(0), z_final.stride(1),
        f, dv, math.sqrt(scale), scale / math.sqrt(2.0), scale, eps,
        FP=feature_block(f), BT=16, BV=block_v, num_warps=8,
    )
    return out, s_final, z_final
