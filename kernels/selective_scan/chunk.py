"""Triton varlen prefill for Mamba-1's selective scan: the recurrence token by token, the state on chip.

One program owns ``BD`` channels of one segment of a sequence and keeps their ``[BD, N]`` state in registers.
Triton lays that state out as it reads the state rows (``N``-contiguous; at a real launch the strides and
``d_state`` are multiples of 16, so the loads are vectorised): at 32 channels on one warp and N 16, each thread
holds 4 channels x 4 state entries, and ``y = C . h`` is 3 in-thread adds and a two-step shuffle reduction per
channel (8 shuffles per token in the compiled sm_90 loop). Per token it discretises ``dt`` (bias, softplus),
updates ``h <- exp(dt A) h + dt B x``, reads out ``y = C . h + D x`` gated by ``silu(z)``, and stores ``y`` in
the output dtype; the next token's inputs are loaded before this one's update. Both kernels take ``exp(dt A)``
as ``exp2`` of ``dt`` times ``A log2 e`` (scaled once per program, as A is loaded): ``exp`` costs a multiply and a
denormal-range fix-up per state entry (the segment-state loop: 216 instructions per token with ``exp``, 152
with ``exp2``; 133 with :func:`softplus_f32`'s polynomial ``log1p``; the scan loop is 214). The initial state
is read from, and the final state written to, the sequence's pool slot (or a plain ``[B, Di, N]`` tensor).

Walked whole, one long prompt gives only ``Di / BD`` programs, each as long as the prompt. The wrapper cuts
sequences longer than ``segment_len`` into segments scanned in parallel, in two launches:
``_segment_state_kernel`` runs every segment but a sequence's last from a zero state (the initial state for a
sequence's first segment) and keeps its end state and the sum of its ``dt``; the scan kernel then starts each
segment from the earlier segments' end states folded together (``h <- exp(A sum dt) h + h_segment``).

H200, one mamba-370m layer (``Di`` 2048, N 16, bf16 inputs), ``benchmarks/scan_tune.py``: one 16,384-token
prompt 18.7K tok/ms (the previous kernel, chunks of 16 tokens composed with ``tl.associative_scan``: 8.4K);
8 x 2048 tokens 19.9K (11.6K).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rnnserve.kernels.backend import int64_table, per_cu_seqlens, unit_stride_last
from rnnserve.kernels.selective_scan.fused_recurrent import LOG2_E, silu_f32, softplus_f32

# Segments of a long sequence scanned in parallel (H200, scan_tune: 512 beat 256 and 1024 at 1 x 16384 and
# 8 x 2048); 32 channels in one warp per program (64 over 2 warps: 5% slower; loops unrolled by 2-8 tokens
# instead of the prefetch: 12-30% slower).
SEGMENT_LEN = 512
BLOCK_D = 32
NUM_WARPS = 1


@triton.jit
def _mask_if(mask, cond):
    """``mask`` where the scalar ``cond`` holds, else all false (broadcast explicitly: Triton's interpreter
    rejects a mask built from a scalar predicate)."""
    return mask & ((mask.to(tl.int32) * 0 + cond.to(tl.int32)) != 0)


@triton.jit
def _segment_bounds(seg_ptr, num_segments, cu_seqlens_ptr, i_s, SPLIT: tl.constexpr):
    """``(bos, eos, sequence, first segment of the sequence, is first, is last)`` of program ``i_s``: a row of
    the segment table (start, end, sequence, first segment) with ``SPLIT``, else the whole sequence ``i_s``."""
    if SPLIT:
        bos = tl.load(seg_ptr + i_s).to(tl.int64)
        eos = tl.load(seg_ptr + num_segments + i_s).to(tl.int64)
        i_b = tl.load(seg_ptr + 2 * num_segments + i_s).to(tl.int64)
        first = tl.load(seg_ptr + 3 * num_segments + i_s).to(tl.int64)
        is_last = eos == tl.load(cu_seqlens_ptr + i_b + 1).to(tl.int64)
    else:
        bos = tl.load(cu_seqlens_ptr + i_s).to(tl.int64)
        eos = tl.load(cu_seqlens_ptr + i_s + 1).to(tl.int64)
        i_b = i_s.to(tl.int64)
        first = i_b
        is_last = True
    return bos, eos, i_b, first, first == i_s, is_last


@triton.jit
def _load_token(x_ptr, dt_ptr, B_ptr, C_ptr, z_ptr, row, stride_x, stride_dt, stride_B, stride_C, stride_z, offs_d,
                offs_n, mask_d, mask_n, HAS_C: tl.constexpr, HAS_Z: tl.constexpr):
    """One token's ``(x, dt, B, C, z)`` in their own dtypes (``C`` is ``B`` without ``HAS_C``, ``z`` is ``x``
    without a gate)."""
    x = tl.load(x_ptr + row * stride_x + offs_d, mask=mask_d, other=0.0)
    B = tl.load(B_ptr + row * stride_B + offs_n, mask=mask_n, other=0.0)
    C = B
    if HAS_C:
        C = tl.load(C_ptr + row * stride_C + offs_n, mask=mask_n, other=0.0)
    z = x
    if HAS_Z:
        z = tl.load(z_ptr + row * stride_z + offs_d, mask=mask_d, other=0.0)
    return x, tl.load(dt_ptr + row * stride_dt + offs_d, mask=mask_d, other=0.0), B, C, z


@triton.jit
def _discretise(dt, x, dt_bias, HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr):
    """One token's ``dt [BD]`` with bias and softplus, and its input ``dt * x``."""
    dt = dt.to(tl.float32)
    if HAS_DT_BIAS:
        dt += dt_bias
    if DT_SOFTPLUS:
        dt = softplus_f32(dt)
    return dt, dt * x.to(tl.float32)


@triton.jit
def _channel_block(A_ptr, dt_bias_ptr, i_d, dim, d_state, HAS_DT_BIAS: tl.constexpr, BD: tl.constexpr,
                   BN: tl.constexpr):
    """Program ``i_d``'s channels: ``(offs_d, offs_n, mask_d, mask_n, mask_dn, A [BD, BN] fp32, dt bias [BD])``
    (``A`` scaled by log2 e: both kernels take exp(dt A) as exp2(dt A log2 e))."""
    offs_d = i_d * BD + tl.arange(0, BD)
    offs_n = tl.arange(0, BN)
    mask_d = offs_d < dim
    mask_n = offs_n < d_state
    mask_dn = mask_d[:, None] & mask_n[None, :]
    A = tl.load(A_ptr + offs_d[:, None] * d_state + offs_n[None, :], mask=mask_dn, other=0.0).to(tl.float32) * LOG2_E
    dt_bias = tl.zeros([BD], dtype=tl.float32)
    if HAS_DT_BIAS:
        dt_bias = tl.load(dt_bias_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    return offs_d, offs_n, mask_d, mask_n, mask_dn, A, dt_bias


@triton.jit(do_not_specialize=["num_segments"])  # varies by batch: one build for every batch
def _segment_state_kernel(
    x_ptr, dt_ptr, dt_bias_ptr, A_ptr, B_ptr, cu_seqlens_ptr, seg_ptr, num_segments, state_segments_ptr,
    h0_ptr, slot_ids_ptr, seg_state_ptr, seg_dt_ptr, seg_start_ptr,
    dim, d_state, stride_x, stride_dt, stride_B, stride_h0_slot, stride_h0_d,
    HAS_H0: tl.constexpr, HAS_SLOTS: tl.constexpr, HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr,
    BD: tl.constexpr, BN: tl.constexpr,
):
    i_s = tl.load(state_segments_ptr + tl.program_id(0)).to(tl.int64)
    i_d = tl.program_id(1)
    bos, eos, i_b, first, is_first, is_last = _segment_bounds(seg_ptr, num_segments, cu_seqlens_ptr, i_s, True)
    offs_d, offs_n, mask_d, mask_n, mask_dn, A, dt_bias = _channel_block(A_ptr, dt_bias_ptr, i_d, dim, d_state,
                                                                         HAS_DT_BIAS, BD, BN)
    state_offs = (i_s * dim + offs_d[:, None]) * d_state + offs_n[None, :]
    state = tl.zeros([BD, BN], dtype=tl.float32)
    if HAS_H0:
        # The sequence's initial state, copied aside for the scan kernel (which overwrites the pool slot).
        row = i_b
        if HAS_SLOTS:
            row = tl.load(slot_ids_ptr + i_b).to(tl.int64)
        h0 = tl.load(h0_ptr + row * stride_h0_slot + offs_d[:, None] * stride_h0_d + offs_n[None, :],
                     mask=_mask_if(mask_dn, is_first), other=0.0)
        tl.store(seg_start_ptr + state_offs, h0, mask=_mask_if(mask_dn, is_first))
        state = h0.to(tl.float32)
    dt_sum = tl.zeros([BD], dtype=tl.float32)
    # Segments here are never empty; the next row index is clamped into the segment.
    x_next, dt_next, B_next, _, _ = _load_token(x_ptr, dt_ptr, B_ptr, B_ptr, x_ptr, bos, stride_x, stride_dt,
                                                stride_B, 0, 0, offs_d, offs_n, mask_d, mask_n, False, False)
    for t in range(bos, eos):
        dt, u = _discretise(dt_next, x_next, dt_bias, HAS_DT_BIAS, DT_SOFTPLUS)
        B = B_next.to(tl.float32)
        x_next, dt_next, B_next, _, _ = _load_token(
            x_ptr, dt_ptr, B_ptr, B_ptr, x_ptr, tl.minimum(t + 1, eos - 1), stride_x, stride_dt, stride_B, 0, 0,
            offs_d, offs_n, mask_d, mask_n, False, False,
        )
        state = tl.exp2(dt[:, None] * A) * state + u[:, None] * B[None, :]
        dt_sum += dt
    tl.store(seg_state_ptr + state_offs, state, mask=mask_dn)
    tl.store(seg_dt_ptr + i_s * dim + offs_d, dt_sum, mask=mask_d)


@triton.jit(do_not_specialize=["num_segments"])  # varies by batch: one build for every batch
def _selective_scan_varlen_kernel(
    x_ptr, dt_ptr, dt_bias_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, y_ptr, cu_seqlens_ptr,
    h0_ptr, ht_ptr, slot_ids_ptr, seg_ptr, num_segments, seg_state_ptr, seg_dt_ptr, seg_start_ptr,
    dim, d_state, stride_x, stride_dt, stride_B, stride_C, stride_z,
    stride_h0_slot, stride_h0_d, stride_ht_slot, stride_ht_d,
    HAS_H0: tl.constexpr, HAS_SLOTS: tl.constexpr, HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, SPLIT: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr,
):
    i_s = tl.program_id(0)
    i_d = tl.program_id(1)
    bos, eos, i_b, first, is_first, is_last = _segment_bounds(seg_ptr, num_segments, cu_seqlens_ptr, i_s, SPLIT)
    if HAS_SLOTS:
        row = tl.load(slot_ids_ptr + i_b).to(tl.int64)
    else:
        row = i_b
    offs_d, offs_n, mask_d, mask_n, mask_dn, A, dt_bias = _channel_block(A_ptr, dt_bias_ptr, i_d, dim, d_state,
                                                                         HAS_DT_BIAS, BD, BN)
    D = tl.zeros([BD], dtype=tl.float32)
    if HAS_D:
        D = tl.load(D_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    carry = tl.zeros([BD, BN], dtype=tl.float32)
    if HAS_H0:
        h0_ptrs = h0_ptr + row * stride_h0_slot + offs_d[:, None] * stride_h0_d + offs_n[None, :]
        if SPLIT:
            carry = tl.load(h0_ptrs, mask=_mask_if(mask_dn, is_first & is_last), other=0.0).to(tl.float32)
            # A split sequence's initial state was copied aside before its last segment overwrites the slot.
            start_ptrs = seg_start_ptr + (i_s * dim + offs_d[:, None]) * d_state + offs_n[None, :]
            carry += tl.load(start_ptrs, mask=_mask_if(mask_dn, is_first & (is_last == 0)), other=0.0)
        else:
            carry = tl.load(h0_ptrs, mask=mask_dn, other=0.0).to(tl.float32)
    if SPLIT:
        for j in range(first, i_s):
            decay = tl.exp2(tl.load(seg_dt_ptr + j * dim + offs_d, mask=mask_d, other=0.0)[:, None] * A)
            own = tl.load(seg_state_ptr + (j * dim + offs_d[:, None]) * d_state + offs_n[None, :], mask=mask_dn,
                          other=0.0)
            carry = decay * carry + own
    # Token by token, the next token's loads issued before this one's update; an empty sequence reads a row
    # it never uses (clamped into the tensor) and keeps its initial state.
    x_next, dt_next, B_next, C_next, z_next = _load_token(
        x_ptr, dt_ptr, B_ptr, C_ptr, z_ptr, tl.maximum(tl.minimum(bos, eos - 1), 0), stride_x, stride_dt, stride_B,
        stride_C, stride_z, offs_d, offs_n, mask_d, mask_n, True, HAS_Z,
    )
    for t in range(bos, eos):
        x = x_next.to(tl.float32)
        dt, u = _discretise(dt_next, x_next, dt_bias, HAS_DT_BIAS, DT_SOFTPLUS)
        B, C, z = B_next.to(tl.float32), C_next.to(tl.float32), z_next.to(tl.float32)
        x_next, dt_next, B_next, C_next, z_next = _load_token(
            x_ptr, dt_ptr, B_ptr, C_ptr, z_ptr, tl.minimum(t + 1, eos - 1), stride_x, stride_dt, stride_B, stride_C,
            stride_z, offs_d, offs_n, mask_d, mask_n, True, HAS_Z,
        )
        carry = tl.exp2(dt[:, None] * A) * carry + u[:, None] * B[None, :]
        y = tl.sum(carry * C[None, :], axis=1) + D * x
        if HAS_Z:
            y *= silu_f32(z)
        tl.store(y_ptr + t * dim + offs_d, y.to(y_ptr.dtype.element_ty), mask=mask_d)
    ht_ptrs = ht_ptr + row * stride_ht_slot + offs_d[:, None] * stride_ht_d + offs_n[None, :]
    if SPLIT:
        tl.store(ht_ptrs, carry, mask=_mask_if(mask_dn, is_last))
    else:
        tl.store(ht_ptrs, carry, mask=mask_dn)


def _segment_table(cu_seqlens: torch.Tensor, segment_len: int) -> tuple[torch.Tensor, torch.Tensor, int] | None:
    """``(table [4 * S]: start, end, sequence, first segment of the sequence; ids of the segments that are not
    their sequence's last; S)`` with each sequence cut into near-equal segments of at most ``segment_len``
    tokens, or None when no sequence is longer than ``segment_len``; built once per ``cu_seqlens`` tensor
    (shared by a model's layers)."""
    return per_cu_seqlens(cu_seqlens, ("scan_segments", segment_len),
                          lambda bounds: _build_segment_table(bounds, segment_len, cu_seqlens.device))


def _build_segment_table(
    bounds: list[int], segment_len: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, int] | None:
    if max(end - start for start, end in zip(bounds[:-1], bounds[1:], strict=True)) <= segment_len:
        return None
    starts: list[int] = []
    ends: list[int] = []
    sequences: list[int] = []
    firsts: list[int] = []
    not_last: list[int] = []
    for b, (bos, eos) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        size = max(1, triton.cdiv(eos - bos, triton.cdiv(eos - bos, segment_len) or 1))
        first = len(starts)
        for begin in range(bos, max(eos, bos + 1), size):
            starts.append(begin)
            ends.append(min(begin + size, eos))
            sequences.append(b)
            firsts.append(first)
        not_last.extend(range(first, len(starts) - 1))
    table = int64_table(starts + ends + sequences + firsts + not_last, device)
    num_segments = len(starts)
    return table[: 4 * num_segments], table[4 * num_segments :], num_segments


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
    out_dtype: torch.dtype = torch.float32,
    block_d: int = BLOCK_D,
    num_warps: int = NUM_WARPS,
    segment_len: int = SEGMENT_LEN,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed ``x, dt, z [T, Di]``, ``B, C [T, N]`` -> ``(y [T, Di] in out_dtype, final_state)``.

    Without ``slot_ids`` the states are ``[B, Di, N]`` (``initial_state`` optional, a new final tensor is
    returned). With ``slot_ids`` ``initial_state`` is a state pool ``[num_slots, Di, N]`` (fp32, unit stride
    on N): rows ``slot_ids`` are read and overwritten in place, and the pool is returned. ``block_d`` (channels
    per program, a power of two), ``num_warps`` and ``segment_len`` (tokens per parallel segment of a long
    sequence; 0 never splits) set the launch; ``benchmarks/scan_tune.py`` times the choices.
    """
    total, dim = x.shape
    batch = cu_seqlens.numel() - 1
    d_state = A.shape[1]
    x, dt, B, C = unit_stride_last(x), unit_stride_last(dt), unit_stride_last(B), unit_stride_last(C)
    z = None if z is None else unit_stride_last(z)
    A = A.contiguous()  # read as fp32 and scaled by log2 e in-kernel
    D = None if D is None else D.float().contiguous()
    dt_bias = None if dt_bias is None else dt_bias.float().contiguous()
    y = torch.empty(total, dim, dtype=out_dtype, device=x.device)
    if slot_ids is not None:
        if initial_state is None or initial_state.dtype != torch.float32 or initial_state.stride(-1) != 1:
            raise ValueError("slot_ids needs an fp32 state pool with unit stride on the state dimension")
        h0 = final = initial_state
        slot_ids = slot_ids.long().contiguous()
    else:
        final = torch.empty(batch, dim, d_state, dtype=torch.float32, device=x.device)
        h0 = final if initial_state is None else unit_stride_last(initial_state.float())
    if total == 0:  # nothing to scan: every final state is its initial state
        if slot_ids is None:
            final.copy_(h0) if initial_state is not None else final.zero_()
        return y, final
    blocks = triton.cdiv(dim, block_d)
    # Only prompts longer than a segment pay for the host-side table (it reads the lengths).
    segments = _segment_table(cu_seqlens, segment_len) if 0 < segment_len < total else None
    flags = dict(HAS_H0=initial_state is not None, HAS_SLOTS=slot_ids is not None, HAS_DT_BIAS=dt_bias is not None,
                 DT_SOFTPLUS=dt_softplus, BD=block_d, BN=triton.next_power_of_2(d_state), num_warps=num_warps)
    slots_arg = slot_ids if slot_ids is not None else cu_seqlens
    dt_bias_arg = dt_bias if dt_bias is not None else dt
    if segments is None:
        table, num_segments, seg_state, seg_dt, seg_start = cu_seqlens, batch, final, final, final
    else:
        table, state_segments, num_segments = segments
        seg_state = torch.empty(num_segments, dim, d_state, dtype=torch.float32, device=x.device)
        seg_start = torch.empty_like(seg_state) if initial_state is not None else seg_state
        seg_dt = torch.empty(num_segments, dim, dtype=torch.float32, device=x.device)
        _segment_state_kernel[(state_segments.numel(), blocks)](
            x, dt, dt_bias_arg, A, B, cu_seqlens, table, num_segments, state_segments, h0, slots_arg,
            seg_state, seg_dt, seg_start, dim, d_state, x.stride(0), dt.stride(0), B.stride(0),
            h0.stride(0), h0.stride(1), **flags,
        )
    _selective_scan_varlen_kernel[(num_segments, blocks)](
        x, dt, dt_bias_arg, A, B, C, D if D is not None else x, z if z is not None else x, y, cu_seqlens, h0,
        final, slots_arg, table, num_segments, seg_state, seg_dt, seg_start,
        dim, d_state, x.stride(0), dt.stride(0), B.stride(0), C.stride(0), z.stride(0) if z is not None else 0,
        h0.stride(0), h0.stride(1), final.stride(0), final.stride(1),
        HAS_D=D is not None, HAS_Z=z is not None, SPLIT=segments is not None, **flags,
    )
    return y, final
