"""Triton chunked varlen prefill for Mamba-2's SSD: five kernels, no Python loop over chunks.

Every sequence is cut into chunks of ``L`` tokens (256 by default; a chunk never straddles two sequences, the
table of chunks is built once on the host from ``cu_seqlens``, and a sequence's last chunk may be short).
No kernel holds an ``[L, L]`` tile: the chunk is tiled in blocks of ``BM`` output rows and ``BK`` source
tokens, and every tile masks the rows past its chunk's end.

1. ``_ssd_chunk_cumsum_kernel``: per (chunk, block of heads), the discretised ``dt`` (optionally
   ``softplus(dt + dt_bias)`` clamped to ``dt_limit``, stored in fp32 for the kernels below) and the decay
   prefix ``cum_l = sum_{s<=l} dt_s A`` (stored in base 2, times log2 e, so that every ``exp`` below is an
   ``exp2``);
2. ``_ssd_chunk_cb_kernel``: per (chunk, group), the lower-triangular ``[BM, BK]`` blocks of ``C_l . B_s``,
   shared by every head of the group (optional: the output kernel can recompute them per head instead);
3. ``_ssd_chunk_state_kernel``: per (chunk, head, channel block, state block), the chunk's own end state
   ``sum_s exp(cum_end - cum_s) dt_s x_s B_s^T``, one ``tl.dot`` per block of ``BK`` tokens;
4. ``_ssd_state_passing_kernel``: per (sequence, head, slice of the state), a sequential pass over the
   sequence's chunks carrying ``S = exp(cum_end) S + chunk_state``; it overwrites each chunk's state with the
   state entering the chunk, reads the initial state from and writes the final state to the sequence's pool
   slot, and loads the next chunk's state while it updates the current one;
5. ``_ssd_chunk_scan_kernel``: per (chunk, head, channel block, block of ``BM`` output rows),
   ``y_l = exp(cum_l) C_l S_in + sum_{s<=l} (C_l . B_s) exp(cum_l - cum_s) dt_s x_s + D x_l``, looping over
   the source blocks up to the diagonal only (the row blocks with the most source blocks are launched first).

Products of two inputs (``x``, ``B``, ``C``) keep the input dtype (bf16/fp16 on tensor cores). Products with an
fp32 operand (the incoming state, the decay-weighted scores and inputs) stay fp32: tf32 tensor cores for
bf16/fp16 inputs, whose 10-bit mantissa keeps them within the tolerance of the token-by-token recurrence
(rounding the state to bf16 there put outputs 0.07 off on an H200), exact ``ieee`` products for fp32 inputs.
Accumulation is fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rnnserve.kernels.backend import int64_table, per_cu_seqlens, unit_stride_last
from rnnserve.kernels.selective_scan.fused_recurrent import LOG2_E, softplus_f32

MAX_CHUNKS = 65535  # the chunk index is the launch grid's second axis


@triton.jit
def _ssd_chunk_cumsum_kernel(
    dt_ptr, dt_bias_ptr, A_ptr, chunk_start_ptr, chunk_end_ptr, cum_ptr, dt_out_ptr, heads, stride_dt,
    dt_min, dt_max,
    HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr, DT_LIMIT: tl.constexpr, L: tl.constexpr,
    BH: tl.constexpr,
):
    i_hb = tl.program_id(0)
    i_c = tl.program_id(1).to(tl.int64)
    start = tl.load(chunk_start_ptr + i_c)
    length = (tl.load(chunk_end_ptr + i_c) - start).to(tl.int32)
    offs_l = tl.arange(0, L)
    offs_h = i_hb * BH + tl.arange(0, BH)
    mask_h = offs_h < heads
    mask = (offs_l < length)[:, None] & mask_h[None, :]
    dt = tl.load(dt_ptr + start * stride_dt + offs_l[:, None] * stride_dt + offs_h[None, :],
                 mask=mask, other=0.0).to(tl.float32)
    if HAS_DT_BIAS:
        dt += tl.load(dt_bias_ptr + offs_h, mask=mask_h, other=0.0).to(tl.float32)[None, :]
    if DT_SOFTPLUS:
        dt = softplus_f32(dt)
    if DT_LIMIT:
        # torch's clamp keeps a NaN step size; tl.maximum / tl.minimum drop NaN unless told.
        dt = tl.maximum(dt, dt_min, propagate_nan=tl.PropagateNan.ALL)
        dt = tl.minimum(dt, dt_max, propagate_nan=tl.PropagateNan.ALL)
    dt = tl.where(mask, dt, 0.0)
    # The discretised dt, read by the chunk-state and output kernels.
    tl.store(dt_out_ptr + (start + offs_l[:, None]) * heads + offs_h[None, :], dt, mask=mask)
    A = tl.load(A_ptr + offs_h, mask=mask_h, other=0.0).to(tl.float32) * LOG2_E
    cum = tl.cumsum(dt * A[None, :], axis=0)  # constant past the chunk's end, so cum[L - 1] is the chunk's decay
    tl.store(cum_ptr + i_c * heads * L + offs_h[None, :] * L + offs_l[:, None], cum, mask=mask_h[None, :])


@triton.jit
def _cb_block(C_base, B_base, offs_m, offs_k, mask_m, mask_k, d_state, stride_C_t, stride_B_t,
              DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
              BN: tl.constexpr):
    """``C_l . B_s`` for a ``[BM, BK]`` block of a chunk (rows past its end read as zero), ``BN`` state indices
    per product, in the input dtype with fp32 accumulation."""
    cb = tl.zeros([BM, BK], dtype=tl.float32)
    for n in range(0, d_state, BN):
        offs_n = n + tl.arange(0, BN)
        mask_n = offs_n < d_state
        C = tl.load(C_base + offs_m[:, None] * stride_C_t + offs_n[None, :],
                    mask=mask_m[:, None] & mask_n[None, :], other=0.0).to(DOT_DTYPE)
        B = tl.load(B_base + offs_k[:, None] * stride_B_t + offs_n[None, :],
                    mask=mask_k[:, None] & mask_n[None, :], other=0.0).to(DOT_DTYPE)
        cb += tl.dot(C, tl.trans(B), input_precision=PRECISION)
    return cb


@triton.jit
def _ssd_chunk_cb_kernel(
    B_ptr, C_ptr, chunk_start_ptr, chunk_end_ptr, cb_ptr, groups, d_state,
    stride_B_t, stride_B_g, stride_C_t, stride_C_g,
    DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr, L: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
    BN: tl.constexpr,
):
    pid = tl.program_id(0)
    i_c = tl.program_id(1).to(tl.int64)
    i_k = pid % (L // BK)
    i_m = (pid // (L // BK)) % (L // BM)
    group = pid // ((L // BK) * (L // BM))
    start = tl.load(chunk_start_ptr + i_c)
    length = (tl.load(chunk_end_ptr + i_c) - start).to(tl.int32)
    # Blocks wholly above the diagonal or past the chunk's end are never read.
    if (i_k * BK < i_m * BM + BM) & (i_m * BM < length):
        offs_m = i_m * BM + tl.arange(0, BM)
        offs_k = i_k * BK + tl.arange(0, BK)
        mask_m = offs_m < length
        mask_k = offs_k < length
        C_base = C_ptr + start * stride_C_t + group * stride_C_g
        B_base = B_ptr + start * stride_B_t + group * stride_B_g
        cb = _cb_block(C_base, B_base, offs_m, offs_k, mask_m, mask_k, d_state, stride_C_t, stride_B_t, DOT_DTYPE,
                       PRECISION, BM, BK, BN)
        tl.store(cb_ptr + (i_c * groups + group) * L * L + offs_m[:, None] * L + offs_k[None, :], cb)


@triton.jit
def _ssd_chunk_state_kernel(
    x_ptr, dt_ptr, B_ptr, chunk_start_ptr, chunk_end_ptr, cum_ptr, states_ptr,
    heads, head_dim, d_state, heads_per_group,
    stride_x_t, stride_x_h, stride_dt, stride_B_t, stride_B_g,
    PRECISION: tl.constexpr, L: tl.constexpr, BK: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
):
    pid = tl.program_id(0)
    i_c = tl.program_id(1).to(tl.int64)
    blocks_n = tl.cdiv(d_state, BN)
    blocks_p = tl.cdiv(head_dim, BP)
    i_n = pid % blocks_n
    i_p = (pid // blocks_n) % blocks_p
    i_h = pid // (blocks_n * blocks_p)
    group = i_h // heads_per_group
    start = tl.load(chunk_start_ptr + i_c)
    length = (tl.load(chunk_end_ptr + i_c) - start).to(tl.int32)
    cum_base = cum_ptr + (i_c * heads + i_h) * L
    cum_end = tl.load(cum_base + L - 1)
    x_base = x_ptr + start * stride_x_t + i_h * stride_x_h
    B_base = B_ptr + start * stride_B_t + group * stride_B_g
    dt_base = dt_ptr + start * stride_dt + i_h
    offs_p = i_p * BP + tl.arange(0, BP)
    offs_n = i_n * BN + tl.arange(0, BN)
    mask_p = offs_p < head_dim
    mask_n = offs_n < d_state
    acc = tl.zeros([BP, BN], dtype=tl.float32)
    for k in range(0, length, BK):
        offs_k = k + tl.arange(0, BK)
        mask_k = offs_k < length
        dt = tl.load(dt_base + offs_k * stride_dt, mask=mask_k, other=0.0).to(tl.float32)
        weight = dt * tl.exp2(cum_end - tl.load(cum_base + offs_k))  # [BK]
        x = tl.load(x_base + offs_k[:, None] * stride_x_t + offs_p[None, :],
                    mask=mask_k[:, None] & mask_p[None, :], other=0.0).to(tl.float32)
        B = tl.load(B_base + offs_k[:, None] * stride_B_t + offs_n[None, :],
                    mask=mask_k[:, None] & mask_n[None, :], other=0.0).to(tl.float32)
        acc += tl.dot(tl.trans(x * weight[:, None]), B, input_precision=PRECISION)  # [BP, BN]
    out = states_ptr + (i_c * heads + i_h) * head_dim * d_state + offs_p[:, None] * d_state + offs_n[None, :]
    tl.store(out, acc, mask=mask_p[:, None] & mask_n[None, :])


@triton.jit
def _ssd_state_passing_kernel(
    cum_ptr, states_ptr, seq_first_chunk_ptr, h0_ptr, ht_ptr, slot_ids_ptr,
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
    step = heads * state_size
    upcoming = tl.load(states_ptr + (first * heads + i_h) * state_size + offs,
                       mask=offs < tl.where(first < last, state_size, 0), other=0.0)
    for c in range(first, last):
        chunk = states_ptr + (c * heads + i_h) * state_size + offs
        own = upcoming
        upcoming = tl.load(chunk + step, mask=offs < tl.where(c + 1 < last, state_size, 0), other=0.0)
        decay = tl.exp2(tl.load(cum_ptr + (c * heads + i_h) * L + L - 1))
        tl.store(chunk, state, mask=mask)  # the chunk's own state is replaced by the state entering it
        state = decay * state + own
    tl.store(ht_ptr + row * stride_ht_slot + i_h * stride_ht_h + offs, state, mask=mask)


@triton.jit
def _ssd_chunk_scan_kernel(
    x_ptr, dt_ptr, B_ptr, C_ptr, D_ptr, chunk_start_ptr, chunk_end_ptr, cum_ptr, cb_ptr, states_ptr, y_ptr,
    heads, head_dim, d_state, heads_per_group, groups,
    stride_x_t, stride_x_h, stride_dt, stride_B_t, stride_B_g, stride_C_t, stride_C_g,
    HAS_D: tl.constexpr, CB_IN_MEMORY: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
    L: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
):
    pid = tl.program_id(0)
    i_c = tl.program_id(1).to(tl.int64)
    blocks_p = tl.cdiv(head_dim, BP)
    i_m = L // BM - 1 - pid % (L // BM)  # the longest row blocks start first
    i_p = (pid // (L // BM)) % blocks_p
    i_h = pid // ((L // BM) * blocks_p)
    group = i_h // heads_per_group
    start = tl.load(chunk_start_ptr + i_c)
    length = (tl.load(chunk_end_ptr + i_c) - start).to(tl.int32)
    if i_m * BM < length:
        offs_m = i_m * BM + tl.arange(0, BM)
        mask_m = offs_m < length
        offs_p = i_p * BP + tl.arange(0, BP)
        mask_p = offs_p < head_dim
        x_base = x_ptr + start * stride_x_t + i_h * stride_x_h
        B_base = B_ptr + start * stride_B_t + group * stride_B_g
        C_base = C_ptr + start * stride_C_t + group * stride_C_g
        dt_base = dt_ptr + start * stride_dt + i_h
        cum_base = cum_ptr + (i_c * heads + i_h) * L
        cum_m = tl.load(cum_base + offs_m)
        acc = tl.zeros([BM, BP], dtype=tl.float32)  # C_l S_in
        state_base = states_ptr + (i_c * heads + i_h) * head_dim * d_state
        for n in range(0, d_state, BN):
            offs_n = n + tl.arange(0, BN)
            mask_n = offs_n < d_state
            C = tl.load(C_base + offs_m[:, None] * stride_C_t + offs_n[None, :],
                        mask=mask_m[:, None] & mask_n[None, :], other=0.0)
            incoming_t = tl.load(state_base + offs_p[None, :] * d_state + offs_n[:, None],
                                 mask=mask_n[:, None] & mask_p[None, :], other=0.0)
            acc += tl.dot(C.to(tl.float32), incoming_t, input_precision=PRECISION)
        acc *= tl.exp2(cum_m)[:, None]
        for k in range(0, tl.minimum(i_m * BM + BM, length), BK):
            offs_k = k + tl.arange(0, BK)
            mask_k = offs_k < length
            if CB_IN_MEMORY:
                cb = tl.load(cb_ptr + (i_c * groups + group) * L * L + offs_m[:, None] * L + offs_k[None, :])
            else:
                cb = _cb_block(C_base, B_base, offs_m, offs_k, mask_m, mask_k, d_state, stride_C_t, stride_B_t,
                               DOT_DTYPE, PRECISION, BM, BK, BN)
            dt = tl.load(dt_base + offs_k * stride_dt, mask=mask_k, other=0.0).to(tl.float32)
            decay = tl.exp2(tl.minimum(cum_m[:, None] - tl.load(cum_base + offs_k)[None, :], 0.0)) * dt[None, :]
            scores = tl.where(offs_m[:, None] >= offs_k[None, :], cb * decay, 0.0)
            x = tl.load(x_base + offs_k[:, None] * stride_x_t + offs_p[None, :],
                        mask=mask_k[:, None] & mask_p[None, :], other=0.0)
            acc += tl.dot(scores, x.to(tl.float32), input_precision=PRECISION)
        mask_mp = mask_m[:, None] & mask_p[None, :]
        if HAS_D:
            x_m = tl.load(x_base + offs_m[:, None] * stride_x_t + offs_p[None, :], mask=mask_mp, other=0.0)
            acc += tl.load(D_ptr + i_h).to(tl.float32) * x_m.to(tl.float32)
        y_base = y_ptr + (start * heads + i_h) * head_dim
        tl.store(y_base + offs_m[:, None] * (heads * head_dim) + offs_p[None, :], acc, mask=mask_mp)


def _chunk_table(cu_seqlens: torch.Tensor, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(start row, end row) of every chunk, and each sequence's first chunk id (plus the total), on the
    device of ``cu_seqlens``; built once per ``cu_seqlens`` tensor (shared by a model's layers)."""
    return per_cu_seqlens(cu_seqlens, ("ssd_chunks", chunk_size),
                          lambda bounds: _build_chunk_table(bounds, chunk_size, cu_seqlens.device))


def _build_chunk_table(
    bounds: list[int], chunk_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    starts, ends, firsts = [], [], [0]
    for b in range(len(bounds) - 1):
        for s in range(bounds[b], bounds[b + 1], chunk_size):
            starts.append(s)
            ends.append(min(s + chunk_size, bounds[b + 1]))
        firsts.append(len(starts))
    table = int64_table(starts + ends + firsts, device)
    return table[: len(starts)], table[len(starts) : 2 * len(starts)], table[2 * len(starts) :]


def _block(requested: int, extent: int) -> int:
    """A power-of-two tile of at least 16 (the tensor-core and interpreter minimum), at most ``extent`` rounded
    up to a power of two."""
    return max(16, min(triton.next_power_of_2(requested), triton.next_power_of_2(extent)))


def ssd_scan_varlen_triton(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    cu_seqlens: torch.Tensor,
    D: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = 256,
    slot_ids: torch.Tensor | None = None,
    *,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    block_m: int = 64,
    block_k: int = 32,
    block_p: int = 64,
    block_n: int = 32,
    state_block_n: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
    precompute_cb: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed ``x [T, H, P]``, ``dt [T, H]`` (discretised), ``B, C [T, G, N]`` -> ``(y [T, H, P] fp32, final)``.

    Without ``slot_ids`` states are ``[B, H, P, N]`` (``initial_state`` optional; a new final tensor is
    returned). With ``slot_ids`` ``initial_state`` is a pool ``[num_slots, H, P, N]`` (fp32, contiguous per
    slot) whose rows ``slot_ids`` are read and overwritten in place; the pool is returned.

    Launch knobs (defaults chosen for sm_90; ``benchmarks/ssd_tune.py`` sweeps them): ``chunk_size`` tokens
    per chunk; ``block_m`` output rows and ``block_p`` channels per output program; ``block_k`` source tokens
    per step (output, ``C . B^T`` and chunk-state kernels); ``block_n`` state indices per step of the
    ``C . B^T`` and ``C . S_in`` products; ``state_block_n`` state indices per chunk-state program;
    ``num_warps``/``num_stages`` of those three kernels; ``precompute_cb`` computes ``C . B^T`` once per
    (chunk, group) instead of once per head inside the output kernel.
    """
    if chunk_size & (chunk_size - 1) or chunk_size < 16:
        raise ValueError(f"chunk_size must be a power of two >= 16, got {chunk_size}")
    total, heads, head_dim = x.shape
    groups, d_state = B.shape[1:]
    batch = cu_seqlens.numel() - 1
    device = x.device
    x, dt, B, C = unit_stride_last(x), unit_stride_last(dt), unit_stride_last(B), unit_stride_last(C)
    A, D = A.contiguous(), None if D is None else D.contiguous()
    dt_min, dt_max = dt_limit
    has_limit = dt_min > 0.0 or dt_max < float("inf")
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
    if num_chunks > MAX_CHUNKS:
        raise ValueError(f"{num_chunks} chunks of {chunk_size} tokens exceed {MAX_CHUNKS}: split the batch")
    y = torch.empty(total, heads, head_dim, dtype=torch.float32, device=device)
    dt_out = torch.empty(total, heads, dtype=torch.float32, device=device)
    cum = torch.empty(num_chunks, heads, chunk_size, dtype=torch.float32, device=device)
    # Each chunk's own end state, replaced in place by the state entering the chunk.
    states = torch.empty(num_chunks, heads, head_dim, d_state, dtype=torch.float32, device=device)
    low_precision = x.dtype in (torch.bfloat16, torch.float16)
    dot_dtype = (tl.bfloat16 if x.dtype == torch.bfloat16 else tl.float16) if low_precision else tl.float32
    precision = "tf32" if low_precision else "ieee"
    block_m, block_k, block_p = _block(block_m, chunk_size), _block(block_k, chunk_size), _block(block_p, head_dim)
    block_n, state_block_n = _block(block_n, d_state), _block(state_block_n, d_state)
    blocks_p = triton.cdiv(head_dim, block_p)
    launch = dict(PRECISION=precision, L=chunk_size, BK=block_k, num_warps=num_warps, num_stages=num_stages)
    if num_chunks:
        _ssd_chunk_cumsum_kernel[(triton.cdiv(heads, 16), num_chunks)](
            dt, dt_bias if dt_bias is not None else A, A, chunk_start, chunk_end, cum, dt_out, heads, dt.stride(0),
            float(dt_min), float(dt_max), HAS_DT_BIAS=dt_bias is not None, DT_SOFTPLUS=dt_softplus,
            DT_LIMIT=has_limit, L=chunk_size, BH=16,
        )
        _ssd_chunk_state_kernel[(heads * blocks_p * triton.cdiv(d_state, state_block_n), num_chunks)](
            x, dt_out, B, chunk_start, chunk_end, cum, states, heads, head_dim, d_state, heads // groups,
            x.stride(0), x.stride(1), heads, B.stride(0), B.stride(1), BP=block_p, BN=state_block_n,
            **launch,
        )
    block = _block(512, state_size)
    _ssd_state_passing_kernel[(batch, heads, triton.cdiv(state_size, block))](
        cum, states, seq_first_chunk, h0, final, slot_ids if slot_ids is not None else seq_first_chunk,
        heads, state_size, h0.stride(0), h0.stride(1), final.stride(0), final.stride(1),
        HAS_H0=initial_state is not None, HAS_SLOTS=slot_ids is not None, L=chunk_size, BLOCK=block,
    )
    if num_chunks:
        cb = cum  # unread unless precompute_cb
        if precompute_cb:
            cb = torch.empty(num_chunks, groups, chunk_size, chunk_size, dtype=torch.float32, device=device)
            _ssd_chunk_cb_kernel[(groups * (chunk_size // block_m) * (chunk_size // block_k), num_chunks)](
                B, C, chunk_start, chunk_end, cb, groups, d_state, B.stride(0), B.stride(1), C.stride(0), C.stride(1),
                DOT_DTYPE=dot_dtype, BM=block_m, BN=block_n, **launch,
            )
        _ssd_chunk_scan_kernel[(heads * blocks_p * (chunk_size // block_m), num_chunks)](
            x, dt_out, B, C, D if D is not None else A, chunk_start, chunk_end, cum, cb, states, y,
            heads, head_dim, d_state, heads // groups, groups,
            x.stride(0), x.stride(1), heads, B.stride(0), B.stride(1), C.stride(0), C.stride(1),
            HAS_D=D is not None, CB_IN_MEMORY=precompute_cb, DOT_DTYPE=dot_dtype, BM=block_m, BP=block_p,
            BN=block_n, **launch,
        )
    return y, final
