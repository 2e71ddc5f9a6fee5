"""Triton decode step for Mamba-1's selective scan, on state-pool slots in place.

One program owns one sequence and ``BD`` channels: it reads the ``[BD, N]`` state rows of the sequence's
slot once, discretises ``dt`` (bias, softplus), applies the update, writes the rows back once and emits
``y = C . h + D x`` gated by ``silu(z)``. No gather or scatter of the state happens outside the kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rnnserve.kernels.backend import unit_stride_last

LOG2_E: tl.constexpr = tl.constexpr(1.4426950408889634)


@triton.jit
def silu_f32(x):
    """``x * sigmoid(x)`` as ``x / (1 + 2^(-x log2 e))``: ``tl.sigmoid``'s ``exp`` adds a denormal-range fix-up, and
    ``/`` is ``div.full`` (2 ulp) where ``div_rn`` is a checked IEEE division with a slow path."""
    return x / (1.0 + tl.exp2(x * -LOG2_E))


@triton.jit
def softplus_f32(x):
    """``log(1 + exp(x))`` like ``torch.nn.functional.softplus`` (linear above 20), accurate for very negative x.

    With ``u = exp(-|x|)`` in (0, 1], softplus is ``max(x, 0) + log1p(u)`` and ``log1p(u) = u q(u)``, ``q`` a
    degree-8 polynomial (a least-squares Chebyshev fit of ``log1p(u) / u`` on [0, 1]; relative error < 3e-7 in
    fp32 over the whole range, where ``log(1 + u)`` loses up to 6e-4 near u = 1e-4 to the rounding of 1 + u).
    Nine FMAs instead of a library ``log`` (about 20 instructions on sm_90) and a branch for small u.
    """
    u = tl.exp(-tl.abs(x))
    q = 0.005185954296159465 * u - 0.029210051359278365
    q = q * u + 0.07753998945043808
    q = q * u - 0.13583904136333347
    q = q * u + 0.1905593478564518
    q = q * u - 0.24825641968267959
    q = q * u + 0.3331600953408254
    q = q * u - 0.4999925580696245
    q = q * u + 0.999999920847579
    return tl.where(x > 20.0, x, tl.maximum(x, 0.0) + u * q)


@triton.jit
def _selective_state_update_kernel(
    state_ptr, slot_ids_ptr, x_ptr, dt_ptr, dt_bias_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, y_ptr,
    dim, d_state, stride_slot, stride_state_d, stride_x, stride_dt, stride_B, stride_C, stride_z,
    HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr, HAS_D: tl.constexpr, HAS_Z: tl.constexpr,
    BD: tl.constexpr, BN: tl.constexpr,
):
    i_b = tl.program_id(0)
    i_d = tl.program_id(1)
    slot = tl.load(slot_ids_ptr + i_b).to(tl.int64)
    offs_d = i_d * BD + tl.arange(0, BD)
    offs_n = tl.arange(0, BN)
    mask_d = offs_d < dim
    mask_n = offs_n < d_state
    mask = mask_d[:, None] & mask_n[None, :]
    x = tl.load(x_ptr + i_b * stride_x + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    dt = tl.load(dt_ptr + i_b * stride_dt + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    if HAS_DT_BIAS:
        dt += tl.load(dt_bias_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    if DT_SOFTPLUS:
        dt = softplus_f32(dt)
    A = tl.load(A_ptr + offs_d[:, None] * d_state + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    B = tl.load(B_ptr + i_b * stride_B + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    C = tl.load(C_ptr + i_b * stride_C + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    state_ptrs = state_ptr + slot * stride_slot + offs_d[:, None] * stride_state_d + offs_n[None, :]
    h = tl.load(state_ptrs, mask=mask, other=0.0)
    h = tl.exp(dt[:, None] * A) * h + (dt * x)[:, None] * B[None, :]
    tl.store(state_ptrs, h, mask=mask)
    y = tl.sum(h * C[None, :], axis=1)
    if HAS_D:
        y += x * tl.load(D_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    if HAS_Z:
        z = tl.load(z_ptr + i_b * stride_z + offs_d, mask=mask_d, other=0.0).to(tl.float32)
        y *= z * tl.sigmoid(z)
    tl.store(y_ptr + i_b * dim + offs_d, y, mask=mask_d)



def selective_state_update_triton(
    state: torch.Tensor,
    slot_ids: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
) -> torch.Tensor:
    """Advance pool rows ``state[slot_ids]`` (``[num_slots, Di, N]`` fp32, unit stride on N) by one token in
    place; ``x, dt, z [B, Di]``, ``B, C [B, N]``, ``A [Di, N]``; returns ``y [B, Di]`` fp32."""
    if state.dtype != torch.float32 or state.stride(-1) != 1:
        raise ValueError("the state pool must be fp32 with unit stride on the state dimension")
    batch, dim = x.shape
    d_state = A.shape[1]
    x, dt, B, C = unit_stride_last(x), unit_stride_last(dt), unit_stride_last(B), unit_stride_last(C)
    z = None if z is None else unit_stride_last(z)
    A = A.float().contiguous()
    D = None if D is None else D.float().contiguous()
    dt_bias = None if dt_bias is None else dt_bias.float().contiguous()
    y = torch.empty(batch, dim, dtype=torch.float32, device=x.device)
    block_n = triton.next_power_of_2(d_state)
    block_d = max(1, min(triton.next_power_of_2(dim), 2048 // block_n))
    grid = (batch, triton.cdiv(dim, block_d))
    _selective_state_update_kernel[grid](
        state, slot_ids.long().contiguous(), x, dt, dt_bias if dt_bias is not None else dt, A, B, C,
        D if D is not None else x, z if z is not None else x, y,
        dim, d_state, state.stride(0), state.stride(1), x.stride(0), dt.stride(0), B.stride(0), C.stride(0),
        z.stride(0) if z is not None else 0,
        HAS_DT_BIAS=dt_bias is not None, DT_SOFTPLUS=dt_softplus, HAS_D=D is not None, HAS_Z=z is not None,
        BD=block_d, BN=block_n,
    )
    return y
