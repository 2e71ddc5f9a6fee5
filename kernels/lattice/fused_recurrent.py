"""Triton kernels for Lattice's orthogonal state recurrence: a fused sequential varlen prefill and a fused
decode step.

The recurrence has no parallel form, so prefill is a sequential scan made fast by fusion: one program per
(sequence, head) loads the head's ``d x m`` state from its slot once, keeps it in registers for the whole
prompt (normalise, project, update, renormalise, read out: every token is a handful of reductions over the
tile) and writes the final state back to the slot. The decode kernel is the same step once per sequence,
update and read-out in one pass, in place on the pool. Inputs are converted to fp32 and the state math runs in
fp32; the step follows
:func:`rnnserve.kernels.lattice.naive.lattice_step_ref` (same rescaling, so huge inputs stay finite).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

VARIANT_IDS = {"dec": 0, "enc": 1, "sim": 2}
MAX_TILE = 4096  # d x m elements held per program: 64 x 64 at 16 warps stays under 128 registers, unspilled


@triton.jit
def _lattice_update(s, q, k, v, gamma, mu, mask, VARIANT: tl.constexpr, NORMALIZE: tl.constexpr):
    """One token on a ``[BD, BM]`` state tile: returns ``(new_state, y)``.

    ``phi = s / |s|`` is never materialised: every use folds ``1 / |s|`` into a per-slot scalar, and the update
    ``coef_s s + coef_w (h_hat - phi (phi . h_hat))`` is one rank-1 correction of a column scaling, so only
    two ``[BD, BM]`` tiles are live at a time.
    """
    tiny = 1e-30
    inv_n = 1.0 / tl.maximum(tl.sqrt(tl.sum(s * s, axis=0)), tiny)
    if VARIANT == 0:
        h = tl.sum(s * (k * inv_n)[None, :], axis=1) - v
        c = k
    elif VARIANT == 1:
        h = v
        c = inv_n * tl.sum(s * v[:, None], axis=0) - k
    else:
        h = -v
        c = k
    a = -gamma * c * inv_n
    if NORMALIZE:
        scale = tl.maximum(tl.max(tl.abs(h), axis=0), tiny)
        h_hat = h / scale
        r_hat = inv_n * tl.sum(s * h_hat[:, None], axis=0)
        b = a * scale
        b_abs = tl.abs(b)
        denom = tl.maximum(b_abs, mu)
        safe = tl.maximum(denom, tiny)
        coef_s = tl.where(denom > 0, mu / safe, 1.0)
        sign_b = tl.where(b > 0, 1.0, tl.where(b < 0, -1.0, 0.0))
        coef_w = tl.where(b_abs >= mu, sign_b, b / safe)
        u = s * (coef_s - coef_w * r_hat * inv_n)[None, :] + h_hat[:, None] * coef_w[None, :]
        u = tl.where(mask, u, 0.0)
        u_norm = tl.sqrt(tl.sum(u * u, axis=0))
        new = tl.where(u_norm[None, :] > 0, u * (1.0 / tl.maximum(u_norm, tiny))[None, :], s)
    else:
        r = inv_n * tl.sum(s * h[:, None], axis=0)
        new = tl.where(mask, s * (mu - a * r * inv_n)[None, :] + h[:, None] * a[None, :], 0.0)
    y = tl.sum(new * q[None, :], axis=1)
    return new, y


@triton.jit
def _lattice_prefill_kernel(
    q_ptr, k_ptr, v_ptr, gamma_ptr, mu_ptr, y_ptr, state_ptr, slot_ids_ptr, cu_seqlens_ptr,
    n_heads, dim, slots, stride_sn, stride_sh, stride_sd, stride_sm,
    VARIANT: tl.constexpr, NORMALIZE: tl.constexpr, HAS_MU: tl.constexpr, BD: tl.constexpr, BM: tl.constexpr,
):
    i_b = tl.program_id(0)
    i_h = tl.program_id(1)
    bos = tl.load(cu_seqlens_ptr + i_b).to(tl.int64)
    eos = tl.load(cu_seqlens_ptr + i_b + 1).to(tl.int64)
    slot = tl.load(slot_ids_ptr + i_b).to(tl.int64)
    offs_d = tl.arange(0, BD)
    offs_m = tl.arange(0, BM)
    mask_d = offs_d < dim
    mask_m = offs_m < slots
    mask = mask_d[:, None] & mask_m[None, :]
    s_ptrs = (state_ptr + slot * stride_sn + i_h * stride_sh
              + offs_d[:, None] * stride_sd + offs_m[None, :] * stride_sm)
    s = tl.load(s_ptrs, mask=mask, other=0.0).to(tl.float32)
    mu = 1.0
    for t in range(bos, eos):
        row = t * n_heads + i_h
        q = tl.load(q_ptr + row * slots + offs_m, mask=mask_m, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + row * slots + offs_m, mask=mask_m, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + row * dim + offs_d, mask=mask_d, other=0.0).to(tl.float32)
        gamma = tl.load(gamma_ptr + row).to(tl.float32)
        if HAS_MU:
            mu = tl.load(mu_ptr + row).to(tl.float32)
        s, y = _lattice_update(s, q, k, v, gamma, mu, mask, VARIANT, NORMALIZE)
        tl.store(y_ptr + row * dim + offs_d, y, mask=mask_d)
    tl.store(s_ptrs, s, mask=mask)


@triton.jit
def _lattice_decode_kernel(
    q_ptr, k_ptr, v_ptr, gamma_ptr, mu_ptr, y_ptr, state_ptr, slot_ids_ptr,
    n_heads, dim, slots, stride_sn, stride_sh, stride_sd, stride_sm,
    VARIANT: tl.constexpr, NORMALIZE: tl.constexpr, HAS_MU: tl.constexpr, BD: tl.constexpr, BM: tl.constexpr,
):
    i_b = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1)
    slot = tl.load(slot_ids_ptr + i_b).to(tl.int64)
    offs_d = tl.arange(0, BD)
    offs_m = tl.arange(0, BM)
    mask_d = offs_d < dim
    mask_m = offs_m < slots
    mask = mask_d[:, None] & mask_m[None, :]
    s_ptrs = (state_ptr + slot * stride_sn + i_h * stride_sh
              + offs_d[:, None] * stride_sd + offs_m[None, :] * stride_sm)
    s = tl.load(s_ptrs, mask=mask, other=0.0).to(tl.float32)
    row = i_b * n_heads + i_h
    q = tl.load(q_ptr + row * slots + offs_m, mask=mask_m, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + row * slots + offs_m, mask=mask_m, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + row * dim + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    gamma = tl.load(gamma_ptr + row).to(tl.float32)
    mu = 1.0
    if HAS_MU:
        mu = tl.load(mu_ptr + row).to(tl.float32)
    s, y = _lattice_update(s, q, k, v, gamma, mu, mask, VARIANT, NORMALIZE)
    tl.store(s_ptrs, s, mask=mask)
    tl.store(y_ptr + row * dim + offs_d, y, mask=mask_d)


def _launch_shape(dim: int, slots: int) -> tuple[int, int, int]:
    """``(BD, BM, num_warps)`` for a ``dim x slots`` state tile."""
    block_d, block_m = triton.next_power_of_2(dim), triton.next_power_of_2(slots)
    if block_d * block_m > MAX_TILE:
        raise ValueError(f"Lattice kernels hold the {dim} x {slots} state on chip: at most {MAX_TILE} elements")
    return block_d, block_m, max(4, block_d * block_m // 256)


def _launch(
    kernel: triton.JITFunction,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gamma: torch.Tensor,
    mu: torch.Tensor | None,
    state: torch.Tensor,
    slot_ids: torch.Tensor,
    cu_seqlens: tuple[torch.Tensor, ...],
    variant: str,
    normalize: bool,
) -> torch.Tensor:
    """Run ``kernel`` on one program per (sequence, head); ``cu_seqlens`` is ``(cu_seqlens,)`` for prefill and
    ``()`` for decode. Inputs are converted to fp32; returns ``y [rows, H, d]`` fp32."""
    if state.dtype != torch.float32:
        raise ValueError(f"Lattice states are fp32, got {state.dtype}")
    rows, n_heads, dim = v.shape
    slots = q.shape[-1]
    q, k, v, gamma = (x.float().contiguous() for x in (q, k, v, gamma))
    y = torch.empty(rows, n_heads, dim, dtype=torch.float32, device=v.device)
    block_d, block_m, num_warps = _launch_shape(dim, slots)
    batch = slot_ids.numel()
    kernel[(batch, n_heads)](
        q, k, v, gamma, gamma if mu is None else mu.float().contiguous(), y, state, slot_ids, *cu_seqlens,
        n_heads, dim, slots, *state.stride(),
        VARIANT=VARIANT_IDS[variant], NORMALIZE=normalize, HAS_MU=mu is not None, BD=block_d, BM=block_m,
        num_warps=num_warps,
    )
    return y


def lattice_varlen_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gamma: torch.Tensor,
    mu: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    state: torch.Tensor,
    slot_ids: torch.Tensor,
    variant: str,
    normalize: bool = True,
) -> torch.Tensor:
    """Fused sequential prefill, same contract as :func:`rnnserve.kernels.lattice.naive.lattice_varlen_ref`."""
    return _launch(_lattice_prefill_kernel, q, k, v, gamma, mu, state, slot_ids, (cu_seqlens,), variant, normalize)


def lattice_decode_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gamma: torch.Tensor,
    mu: torch.Tensor | None,
    state: torch.Tensor,
    slot_ids: torch.Tensor,
    variant: str,
    normalize: bool = True,
) -> torch.Tensor:
    """Fused decode step, same contract as :func:`rnnserve.kernels.lattice.naive.lattice_decode_ref`."""
    return _launch(_lattice_decode_kernel, q, k, v, gamma, mu, state, slot_ids, (), variant, normalize)
