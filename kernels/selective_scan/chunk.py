"""Triton varlen prefill for Mamba-1's selective scan: a chunked parallel scan with the state on chip.

One program owns one sequence and ``BD`` channels and keeps their ``[BD, N]`` state in registers for the
whole prompt. It walks the sequence in chunks of ``BT`` tokens; per chunk it discretises ``dt`` (bias,
softplus), forms the affine maps ``h -> exp(dt A) h + dt B x`` for every (token, channel, state index),
composes them with ``tl.associative_scan`` over time, applies them to the carried state, reads out
``y = C . h + D x`` and gates it with ``silu(z)``. Padding rows are identity maps, so the chunk's last row
always holds the carry. The next chunk's inputs are loaded before this one is scanned, so that the loads'
latency overlaps the scan. The initial state is read from, and the final state written to, the sequence's
pool slot (or a plain ``[B, Di, N]`` tensor).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from rnnserve.kernels.backend import unit_stride_last
from rnnserve.kernels.selective_scan.fused_recurrent import softplus_f32


@triton.jit
def _compose_affine(a_first, b_first, a_next, b_next):
    return a_first * a_next, a_next * b_first + b_next


@triton.jit
def _load_rows(ptr, rows, stride, offs, mask):
    """``[len(rows), len(offs)]`` elements of a row-major matrix, zero where masked, in its own dtype."""
    return tl.load(ptr + rows[:, None] * stride + offs[None, :], mask=mask, other=0.0)


@triton.jit
def _load_chunk(x_ptr, dt_ptr, B_ptr, C_ptr, z_ptr, rows, eos, stride_x, stride_dt, stride_B, stride_C, stride_z,
                offs_d, offs_n, mask_d, mask_n, HAS_Z: tl.constexpr):
    """A chunk's ``(x, dt, B, C, z)`` rows (``z`` is ``x`` without a gate), zero past ``eos``."""
    mask_td = (rows < eos)[:, None] & mask_d[None, :]
    mask_tn = (rows < eos)[:, None] & mask_n[None, :]
    x = _load_rows(x_ptr, rows, stride_x, offs_d, mask_td)
    z = x
    if HAS_Z:
        z = _load_rows(z_ptr, rows, stride_z, offs_d, mask_td)
    return (x, _load_rows(dt_ptr, rows, stride_dt, offs_d, mask_td), _load_rows(B_ptr, rows, stride_B, offs_n, mask_tn),
            _load_rows(C_ptr, rows, stride_C, offs_n, mask_tn), z)


@triton.jit
def _selective_scan_varlen_kernel(
    x_ptr, dt_ptr, dt_bias_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, y_ptr, cu_seqlens_ptr,
    h0_ptr, ht_ptr, slot_ids_ptr,
    dim, d_state, stride_x, stride_dt, stride_B, stride_C, stride_z,
    stride_h0_slot, stride_h0_d, stride_ht_slot, stride_ht_d,
    HAS_H0: tl.constexpr, HAS_SLOTS: tl.constexpr, HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr,
):
    i_b = tl.program_id(0)
    i_d = tl.program_id(1)
    bos = tl.load(cu_seqlens_ptr + i_b).to(tl.int64)
    eos = tl.load(cu_seqlens_ptr + i_b + 1).to(tl.int64)
    if HAS_SLOTS:
        row = tl.load(slot_ids_ptr + i_b).to(tl.int64)
    else:
        row = i_b.to(tl.int64)
    offs_t = tl.arange(0, BT)
    offs_d = i_d * BD + tl.arange(0, BD)
    offs_n = tl.arange(0, BN)
    mask_d = offs_d < dim
    mask_n = offs_n < d_state
    mask_dn = mask_d[:, None] & mask_n[None, :]
    A = tl.load(A_ptr + offs_d[:, None] * d_state + offs_n[None, :], mask=mask_dn, other=0.0).to(tl.float32)
    if HAS_DT_BIAS:
        dt_bias = tl.load(dt_bias_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    if HAS_D:
        D = tl.load(D_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    if HAS_H0:
        h0_ptrs = h0_ptr + row * stride_h0_slot + offs_d[:, None] * stride_h0_d + offs_n[None, :]
        carry = tl.load(h0_ptrs, mask=mask_dn, other=0.0).to(tl.float32)
    else:
        carry = tl.zeros([BD, BN], dtype=tl.float32)
    is_last_row = (offs_t == BT - 1)[:, None, None]
    # The loads of chunk k + 1 are issued before chunk k is scanned, so their latency hides behind its work.
    x_next, dt_next, B_next, C_next, z_next = _load_chunk(
        x_ptr, dt_ptr, B_ptr, C_ptr, z_ptr, bos + offs_t, eos, stride_x, stride_dt, stride_B, stride_C, stride_z,
        offs_d, offs_n, mask_d, mask_n, HAS_Z,
    )
    for start in range(bos, eos, BT):
        rows = start + offs_t
        mask_td = (rows < eos)[:, None] & mask_d[None, :]
        x, dt, B, C = x_next.to(tl.float32), dt_next.to(tl.float32), B_next.to(tl.float32), C_next.to(tl.float32)
        z = z_next.to(tl.float32)
        x_next, dt_next, B_next, C_next, z_next = _load_chunk(
            x_ptr, dt_ptr, B_ptr, C_ptr, z_ptr, rows + BT, eos, stride_x, stride_dt, stride_B, stride_C, stride_z,
            offs_d, offs_n, mask_d, mask_n, HAS_Z,
        )
        if HAS_DT_BIAS:
            dt += dt_bias[None, :]
        if DT_SOFTPLUS:
            dt = softplus_f32(dt)
        dt = tl.where(mask_td, dt, 0.0)  # padding rows: exp(0) = 1 and no input, the identity map
        a = tl.exp(dt[:, :, None] * A[None, :, :])
        b = (dt * x)[:, :, None] * B[:, None, :]
        a, b = tl.associative_scan((a, b), axis=0, combine_fn=_compose_affine)
        h = a * carry[None, :, :] + b
        y = tl.sum(h * C[:, None, :], axis=2)
        if HAS_D:
            y += D[None, :] * x
        if HAS_Z:
            y *= z * tl.sigmoid(z)
        tl.store(y_ptr + rows[:, None] * dim + offs_d[None, :], y, mask=mask_td)
        carry = tl.sum(tl.where(is_last_row, h, 0.0), axis=0)
    ht_ptrs = ht_ptr + row * stride_ht_slot + offs_d[:, None] * stride_ht_d + offs_n[None, :]
    tl.store(ht_ptrs, carry, mask=mask_dn)



@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def selective_scan_varlen_triton(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    cu_seqlens: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
    slot_ids: torch.Tensor | None = None,
    chunk_size: int = 16,
    block_d: int | None = None,
    num_warps: int = 4,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed ``x, dt, z [T, Di]``, ``B, C [T, N]`` -> ``(y [T, Di] fp32, final_state)``.

    Without ``slot_ids`` the states are ``[B, Di, N]`` (``initial_state`` optional, a new final tensor is
    returned). With ``slot_ids`` ``initial_state`` is a state pool ``[num_slots, Di, N]`` (fp32, unit stride
    on N): rows ``slot_ids`` are read and overwritten in place, and the pool is returned. ``chunk_size``
    (tokens per scanned chunk, at most 16), ``block_d`` (channels per program) and ``num_warps`` set the
    launch; ``benchmarks/scan_tune.py`` times the choices.
    """
    if chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two, got {chunk_size}")
    total, dim = x.shape
    batch = cu_seqlens.numel() - 1
    d_state = A.shape[1]
    x, dt, B, C = unit_stride_last(x), unit_stride_last(dt), unit_stride_last(B), unit_stride_last(C)
    z = None if z is None else unit_stride_last(z)
    A = A.float().contiguous()
    D = None if D is None else D.float().contiguous()
    dt_bias = None if dt_bias is None else dt_bias.float().contiguous()
    y = torch.empty(total, dim, dtype=torch.float32, device=x.device)
    if slot_ids is not None:
        if initial_state is None or initial_state.dtype != torch.float32 or initial_state.stride(-1) != 1:
            raise ValueError("slot_ids needs an fp32 state pool with unit stride on the state dimension")
        h0 = final = initial_state
        slot_ids = slot_ids.long().contiguous()
    else:
        final = torch.empty(batch, dim, d_state, dtype=torch.float32, device=x.device)
        h0 = final if initial_state is None else unit_stride_last(initial_state.float())
    block_n = triton.next_power_of_2(d_state)
    block_t = min(chunk_size, 16)
    if block_d is None:
        block_d = max(1, min(triton.next_power_of_2(dim), 4096 // (block_t * block_n)))
        if x.is_cuda and batch * triton.cdiv(dim, block_d) < 2 * _multiprocessors(x.device):
            # Few programs (one long prompt) leave multiprocessors idle: half as many channels per program.
            # H200, mamba-370m layer, 1 x 16384 tokens: 16 channels 4.2K tok/ms, 8 channels 5.9K (scan_tune).
            block_d = max(1, block_d // 2)
    grid = (batch, triton.cdiv(dim, block_d))
    _selective_scan_varlen_kernel[grid](
        x, dt, dt_bias if dt_bias is not None else dt, A, B, C, D if D is not None else x,
        z if z is not None else x, y, cu_seqlens, h0, final, slot_ids if slot_ids is not None else cu_seqlens,
        dim, d_state, x.stride(0), dt.stride(0), B.stride(0), C.stride(0), z.stride(0) if z is not None else 0,
        h0.stride(0), h0.stride(1), final.stride(0), final.stride(1),
        HAS_H0=initial_state is not None, HAS_SLOTS=slot_ids is not None, HAS_DT_BIAS=dt_bias is not None,
        DT_SOFTPLUS=dt_softplus, HAS_D=D is not None, HAS_Z=z is not None, BT=block_t, BD=block_d, BN=block_n,
        num_warps=num_warps,
    )
    return y, final
