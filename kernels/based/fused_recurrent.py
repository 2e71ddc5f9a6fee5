"""Triton decode step of Based's Taylor linear attention: featurise ``q`` and ``k`` in registers, update the
slot's ``S`` and ``z`` and read out in one pass (every state element read once and written once).

One program owns one (sequence, head): it updates ``z`` and the denominator once, then walks the value channels
in blocks of ``BV`` and, within a block, the quadratic rows one ``[F, BV]`` slice per feature ``a`` (the state
rows are laid out as in :mod:`rnnserve.kernels.based.chunk`: constant, linear, quadratic).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from rnnserve.kernels.based.chunk import feature_block


@triton.jit
def _based_step_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, s_ptr, z_ptr, slot_ids_ptr,
    stride_qb, stride_qh, stride_vb, stride_vh, stride_ob, stride_oh,
    stride_sn, stride_sh, stride_sr, stride_zn, stride_zh,
    f, dv, sqrt_scale, quad_scale, eps,
    FP: tl.constexpr, BV: tl.constexpr,
):
    i_b = tl.program_id(0)
    i_h = tl.program_id(1)
    slot = tl.load(slot_ids_ptr + i_b).to(tl.int64)
    offs_f = tl.arange(0, FP)
    mask_f = offs_f < f
    mask_ff = mask_f[:, None] & mask_f[None, :]
    q_head = q_ptr + i_b * stride_qb + i_h * stride_qh
    k_head = k_ptr + i_b * stride_qb + i_h * stride_qh
    q = tl.load(q_head + offs_f, mask=mask_f, other=0.0).to(tl.float32)
    k = tl.load(k_head + offs_f, mask=mask_f, other=0.0).to(tl.float32)
    # z: the constant, linear and (as an [F, F] tile) quadratic features, updated first; then the denominator.
    z_head = z_ptr + slot * stride_zn + i_h * stride_zh
    z_rows = 1 + f + offs_f[:, None] * f + offs_f[None, :]
    z0 = tl.load(z_head) + 1.0
    z1 = tl.load(z_head + 1 + offs_f, mask=mask_f, other=0.0) + sqrt_scale * k
    z2 = tl.load(z_head + z_rows, mask=mask_ff, other=0.0) + quad_scale * k[:, None] * k[None, :]
    den = z0 + sqrt_scale * tl.sum(q * z1, axis=0) + quad_scale * tl.sum(tl.sum(q[:, None] * q[None, :] * z2, 1), 0)
    tl.store(z_head, z0)
    tl.store(z_head + 1 + offs_f, z1, mask=mask_f)
    tl.store(z_head + z_rows, z2, mask=mask_ff)
    s_head = s_ptr + slot * stride_sn + i_h * stride_sh
    for v_start in range(0, dv, BV):
        offs_v = v_start + tl.arange(0, BV)
        mask_v = offs_v < dv
        mask_fv = mask_f[:, None] & mask_v[None, :]
        v = tl.load(v_ptr + i_b * stride_vb + i_h * stride_vh + offs_v, mask=mask_v, other=0.0).to(tl.float32)
        s0 = tl.load(s_head + offs_v, mask=mask_v, other=0.0) + v
        ptr1 = s_head + (1 + offs_f)[:, None] * stride_sr + offs_v[None, :]
        s1 = tl.load(ptr1, mask=mask_fv, other=0.0) + (sqrt_scale * k)[:, None] * v[None, :]
        num = s0 + sqrt_scale * tl.sum(q[:, None] * s1, axis=0)
        tl.store(s_head + offs_v, s0, mask=mask_v)
        tl.store(ptr1, s1, mask=mask_fv)
        for i_a in range(f):  # quadratic rows (a, 0..f-1): S2[a] += k_a k v^T, read against q_a q
            q_a = tl.load(q_head + i_a).to(tl.float32)
            k_a = tl.load(k_head + i_a).to(tl.float32)
            ptr_a = s_head + (1 + f + i_a * f + offs_f)[:, None] * stride_sr + offs_v[None, :]
            s2_a = tl.load(ptr_a, mask=mask_fv, other=0.0) + (quad_scale * k_a * k)[:, None] * v[None, :]
            num += tl.sum((quad_scale * q_a * q)[:, None] * s2_a, axis=0)
            tl.store(ptr_a, s2_a, mask=mask_fv)
        tl.store(o_ptr + i_b * stride_ob + i_h * stride_oh + offs_v, num / (den + eps), mask=mask_v)


def based_step_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    s_pool: torch.Tensor,
    z_pool: torch.Tensor,
    slot_ids: torch.Tensor,
    scale: float,
    eps: float,
) -> torch.Tensor:
    """``q, k [B, H, f]``, ``v [B, H, d]``; pools ``S [N, H, D, d]``, ``z [N, H, D]`` (fp32, strided views fine,
    last dimension contiguous) updated in place at rows ``slot_ids`` -> fp32 ``[B, H, d]``."""
    batch, heads, f = q.shape
    dv = v.shape[2]
    if s_pool.stride(-1) != 1 or z_pool.stride(-1) != 1:
        raise ValueError("the state pools' last dimension must be contiguous")
    q, k = q.contiguous(), k.contiguous()
    if v.stride(2) != 1:
        v = v.contiguous()
    out = torch.empty(batch, heads, dv, dtype=torch.float32, device=q.device)
    block_v = min(64, triton.next_power_of_2(dv))
    _based_step_kernel[(batch, heads)](
        q, k, v, out, s_pool, z_pool, slot_ids,
        q.stride(0), q.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        s_pool.stride(0), s_pool.stride(1), s_pool.stride(2), z_pool.stride(0), z_pool.stride(1),
        f, dv, math.sqrt(scale), scale / math.sqrt(2.0), eps,
        FP=feature_block(f), BV=block_v, num_warps=4,
    )
    return out
