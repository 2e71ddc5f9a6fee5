"""Triton chunked varlen prefill for Mamba-2's SSD: three kernels, no Python loop over chunks.

Every sequence is cut into chunks of ``L`` tokens (a chunk never straddles two sequences; the table of
chunks is built once on the host from ``cu_seqlens``). Per (chunk, head, block of ``BP`` channels):

1. ``_ssd_chunk_state_kernel``: the decay prefix ``cum_l = sum_{s<=l} dt_s A`` and the chunk's own end
   state ``sum_s exp(cum_end - cum_s) dt_s x_s B_s^T`` (one ``tl.dot``), all chunks in parallel;
2. ``_ssd_state_passing_kernel``: per (sequence, head), a short sequential pass over the sequence's chunks
   that records each chunk's incoming state and carries ``S = exp(cum_end) S + chunk_state``; it reads the
   initial state from and writes the final state to the sequence's pool slot;
3. ``_ssd_chunk_scan_kernel``: outputs ``y_l = sum_{s<=l} (C_l . B_s) exp(cum_l - cum_s) dt_s x_s +
   exp(cum_l) C_l S_in + D x_l`` (three ``tl.dot``), all chunks in parallel.

Products of two inputs (``x``, ``B``, ``C``) keep the input dtype (bf16/fp16 on tensor cores). Products with an
fp32 operand (the incoming state, the decay-weighted scores) stay fp32: tf32 tensor cores for bf16/fp16
inputs, whose 10-bit mantissa keeps them within the tolerance of the token-by-token recurrence (rounding the
state to bf16 there put outputs 0.07 off on an H200), exact ``ieee`` products for fp32 inputs. Accumulation is
fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rnnserve.kernels.backend import unit_stride_last


@triton.jit
def _ssd_chunk_state_kernel(
    x_ptr, dt_ptr, A_ptr, B_ptr, chunk_start_ptr, chunk_end_ptr, cum_ptr, states_ptr,
    heads, head_dim, d_state, heads_per_group,
    stride_x_t, stride_x_h, stride_dt, stride_B_t, stride_B_g,
    DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr, L: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
):
    i_c = tl.program_id(0)
    i_h = tl.program_id(1)
    i_p = tl.program_id(2)
    group = i_h // heads_per_group
    start = tl.load(chunk_start_ptr + i_c).to(tl.int64)
    end = tl.load(chunk_end_ptr + i_c).to(tl.int64)
    offs_l = tl.arange(0, L)
    rows = start + offs_l
    mask_l = rows < end
    dt = tl.load(dt_ptr + rows * stride_dt + i_h, mask=mask_l, other=0.0).to(tl.float32)
    cum = tl.cumsum(dt * tl.load(A_ptr + i_h).to(tl.float32), axis=0)
    if i_p == 0:
        tl.store(cum_ptr + (i_c * heads + i_h) * L + offs_l, cum)
    cum_end = tl.sum(tl.where(offs_l == L - 1, cum, 0.0), axis=0)
    weight = dt * tl.exp(cum_end - cum)  # [L]
    offs_p = i_p * BP + tl.arange(0, BP)
    mask_p = offs_p < head_dim
    x = tl.load(x_ptr + rows[:, None] * stride_x_t + i_h * stride_x_h + offs_p[None, :],
                mask=mask_l[:, None] & mask_p[None, :], other=0.0).to(tl.float32)
    xw_t = tl.trans(x * weight[:, None])  # [BP, L]
    for k in range(0, d_state, BN):
        offs_n = k + tl.arange(0, BN)
        mask_n = offs_n < d_state
        B = tl.load(B_ptr + rows[:, None] * stride_B_t + group * stride_B_g + offs_n[None, :],
                    mask=mask_l[:, None] & mask_n[None, :], other=0.0)
        state = tl.dot(xw_t, B.to(tl.float32), input_precision=PRECISION)  # [BP, BN]
        out = states_ptr + ((i_c * heads + i_h) * head_dim + offs_p[:, None]) * d_state + offs_n[None, :]
        tl.store(out, state, mask=mask_p[:, None] & mask_n[None, :])


@triton.jit
def _ssd_state_passing_kernel(
    cum_ptr, states_ptr, incoming_ptr, seq_first_chunk_ptr, h0_ptr, ht_ptr, slot_ids_ptr,
    heads, state_size, stride_h0_slot, stride_h0_h, stride_ht_slot, stride_ht_h,
    HAS_H0: tl.constexpr, HAS_SLOTS: tl.constexpr, L: tl.constexpr, BLOCK: tl.constexpr,
):
    i_b = tl.program_id(0)
    i_h = tl.program_id(1)
    i_e = tl.program_id(2)
    if HAS_SLOTS:
        row = tl.load(slot_ids_ptr + i_b).to(tl.int64)
    else:
        row = i_b.to(tl.int64)
    first = tl.load(seq_first_chunk_ptr + i_b).to(tl.int64)
    last = tl.load(seq_first_chunk_ptr + i_b + 1).to(tl.int64)
    offs = i_e * BLOCK + tl.arange(0, BLOCK)  # flattened (p, n) of a [P, N] head state
    mask = offs < state_size
    if HAS_H0:
        state = tl.load(h0_ptr + row * stride_h0_slot + i_h * stride_h0_h + offs, mask=mask, other=0.0)
    else:
        state = tl.zeros([BLOCK], dtype=tl.float32)
    for c in range(first, last):
        chunk_offset = (c * heads + i_h) * state_size + offs
        tl.store(incoming_ptr + chunk_offset, state, mask=mask)
        decay = tl.exp(tl.load(cum_ptr + (c * heads + i_h) * L + L - 1))
        state = decay * state + tl.load(states_ptr + chunk_offset, mask=mask, other=0.0)
    tl.store(ht_ptr + row * stride_ht_slot + i_h * stride_ht_h + offs, state, mask=mask)


@triton.jit
def _ssd_chunk_scan_kernel(
    x_ptr, dt_ptr, B_ptr, C_ptr, D_ptr, chunk_start_ptr, chunk_end_ptr, cum_ptr, incoming_ptr, y_ptr,
    heads, head_dim, d_state, heads_per_group,
    stride_x_t, stride_x_h, stride_dt, stride_B_t, stride_B_g, stride_C_t, stride_C_g,
    HAS_D: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
    L: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
):
    i_c = tl.program_id(0)
    i_h = tl.program_id(1)
    i_p = tl.program_id(2)
    group = i_h // heads_per_group
    start = tl.load(chunk_start_ptr + i_c).to(tl.int64)
    end = tl.load(chunk_end_ptr + i_c).to(tl.int64)
    offs_l = tl.arange(0, L)
    offs_s = tl.arange(0, L)
    rows = start + offs_l
    mask_l = rows < end
    offs_p = i_p * BP + tl.arange(0, BP)
    mask_p = offs_p < head_dim
    cum = tl.load(cum_ptr + (i_c * heads + i_h) * L + offs_l)
    dt = tl.load(dt_ptr + rows * stride_dt + i_h, mask=mask_l, other=0.0).to(tl.float32)
    scores = tl.zeros([L, L], dtype=tl.float32)  # C_l . B_s
    from_state = tl.zeros([L, BP], dtype=tl.float32)  # C_l S_in
    for k in range(0, d_state, BN):
        offs_n = k + tl.arange(0, BN)
        mask_n = offs_n < d_state
        mask_ln = mask_l[:, None] & mask_n[None, :]
        B = tl.load(B_ptr + rows[:, None] * stride_B_t + group * stride_B_g + offs_n[None, :], mask=mask_ln,
                    other=0.0).to(DOT_DTYPE)
        C = tl.load(C_ptr + rows[:, None] * stride_C_t + group * stride_C_g + offs_n[None, :], mask=mask_ln,
                    other=0.0).to(DOT_DTYPE)
        state_ptrs = incoming_ptr + ((i_c * heads + i_h) * head_dim + offs_p[None, :]) * d_state + offs_n[:, None]
        incoming_t = tl.load(state_ptrs, mask=mask_n[:, None] & mask_p[None, :], other=0.0)  # [BN, BP]
        scores += tl.dot(C, tl.trans(B), input_precision=PRECISION)
        from_state += tl.dot(C.to(tl.float32), incoming_t, input_precision=PRECISION)
    causal = offs_l[:, None] >= offs_s[None, :]
    scores *= tl.exp(tl.where(causal, cum[:, None] - cum[None, :], float("-inf"))) * dt[None, :]
    x_raw = tl.load(x_ptr + rows[:, None] * stride_x_t + i_h * stride_x_h + offs_p[None, :],
                    mask=mask_l[:, None] & mask_p[None, :], other=0.0)
    y = tl.dot(scores, x_raw.to(tl.float32), input_precision=PRECISION)  # [L, BP]
    y += tl.exp(cum)[:, None] * from_state
    if HAS_D:
        y += tl.load(D_ptr + i_h).to(tl.float32) * x_raw.to(tl.float32)
    tl.store(y_ptr + (rows[:, None] * heads + i_h) * head_dim + offs_p[None, :], y,
             mask=mask_l[:, None] & mask_p[None, :])


def _chunk_table(cu_seqlens: torch.Tensor, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(start row, end row) of every chunk, and each sequence's first chunk id (plus the total), on the
    device of ``cu_seqlens``."""
    bounds = cu_seqlens.tolist()
    starts, ends, firsts = [], [], [0]
    for b in range(len(bounds) - 1):
        for s in range(bounds[b], bounds[b + 1], chunk_size):
            starts.append(s)
            ends.append(min(s + chunk_size, bounds[b + 1]))
        firsts.append(len(starts))
    table = torch.tensor(starts + ends + firsts, dtype=torch.int64, device=cu_seqlens.device)
    return table[: len(starts)], table[len(starts) : 2 * len(starts)], table[2 * len(starts) :]



def ssd_scan_varlen_triton(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    cu_seqlens: torch.Tensor,
    D: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = 32,
    slot_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed ``x [T, H, P]``, ``dt [T, H]`` (discretised), ``B, C [T, G, N]`` -> ``(y [T, H, P] fp32, final)``.

    Without ``slot_ids`` states are ``[B, H, P, N]`` (``initial_state`` optional; a new final tensor is
    returned). With ``slot_ids`` ``initial_state`` is a pool ``[num_slots, H, P, N]`` (fp32, contiguous per
    slot) whose rows ``slot_ids`` are read and overwritten in place; the pool is returned.
    """
    if chunk_size & (chunk_size - 1) or chunk_size < 16:
        raise ValueError(f"chunk_size must be a power of two >= 16, got {chunk_size}")
    total, heads, head_dim = x.shape
    groups, d_state = B.shape[1:]
    batch = cu_seqlens.numel() - 1
    device = x.device
    x, dt, B, C = unit_stride_last(x), unit_stride_last(dt), unit_stride_last(B), unit_stride_last(C)
    A = A.float().contiguous()
    D = None if D is None else D.float().contiguous()
    state_size = head_dim * d_state
    if slot_ids is not None:
        if initial_state is None or initial_state.dtype != torch.float32 or not initial_state[0].is_contiguous():
            raise ValueError("slot_ids needs an fp32 state pool, contiguous within each slot's [H, P, N]")
        h0 = final = initial_state
        slot_ids = slot_ids.long().contiguous()
    else:
        final = torch.empty(batch, heads, head_dim, d_state, dtype=torch.float32, device=device)
        h0 = final if initial_state is None else initial_state.float().contiguous()
    chunk_start, chunk_end, seq_first_chunk = _chunk_table(cu_seqlens, chunk_size)
    num_chunks = chunk_start.numel()
    y = torch.empty(total, heads, head_dim, dtype=torch.float32, device=device)
    cum = torch.empty(num_chunks, heads, chunk_size, dtype=torch.float32, device=device)
    states = torch.empty(num_chunks, heads, head_dim, d_state, dtype=torch.float32, device=device)
    incoming = torch.empty_like(states)
    low_precision = x.dtype in (torch.bfloat16, torch.float16)
    dot_dtype = (tl.bfloat16 if x.dtype == torch.bfloat16 else tl.float16) if low_precision else tl.float32
    precision = "tf32" if low_precision else "ieee"
    # 32-token chunks, 64 channels and 32 state indices per product, 8 warps: no spills on sm_90.
    block_n = max(16, min(triton.next_power_of_2(d_state), 32))
    block_p = max(16, min(triton.next_power_of_2(head_dim), 64))
    common = dict(DOT_DTYPE=dot_dtype, PRECISION=precision, L=chunk_size, BP=block_p, BN=block_n, num_warps=8)
    if num_chunks:
        grid = (num_chunks, heads, triton.cdiv(head_dim, block_p))
        _ssd_chunk_state_kernel[grid](
            x, dt, A, B, chunk_start, chunk_end, cum, states, heads, head_dim, d_state, heads // groups,
            x.stride(0), x.stride(1), dt.stride(0), B.stride(0), B.stride(1), **common,
        )
    block = min(triton.next_power_of_2(state_size), 1024)
    _ssd_state_passing_kernel[(batch, heads, triton.cdiv(state_size, block))](
        cum, states, incoming, seq_first_chunk, h0, final, slot_ids if slot_ids is not None else seq_first_chunk,
        heads, state_size, h0.stride(0), h0.stride(1), final.stride(0), final.stride(1),
        HAS_H0=initial_state is not None, HAS_SLOTS=slot_ids is not None, L=chunk_size, BLOCK=block,
    )
    if num_chunks:
        _ssd_chunk_scan_kernel[grid](
            x, dt, B, C, D if D is not None else A, chunk_start, chunk_end, cum, incoming, y,
            heads, head_dim, d_state, heads // groups,
            x.stride(0), x.stride(1), dt.stride(0), B.stride(0), B.stride(1), C.stride(0), C.stride(1),
            HAS_D=D is not None, **common,
        )
    return y, final
