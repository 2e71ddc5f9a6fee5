"""Triton varlen prefill for the causal depthwise conv1d with a state tail.

A program of ``_conv_varlen_kernel`` computes ``BT`` packed tokens x ``BC`` channels from ``x`` alone. The taps of
a sequence's first ``K-1`` tokens reach before its start, into the sequence's ``initial_state`` tail (not the
previous sequence); with an initial state those outputs are left to ``_conv_edges_kernel``, one small program
per (sequence, channel block), which also writes the sequence's final tail (its last ``K-1`` inputs, from the
initial tail when the sequence is shorter). Accumulates in fp32.

sm_90, mamba-370m's launch (16 x 128 tiles on 4 warps, bf16, initial states, SiLU; ``benchmarks/sass_loops.py``):
with the tail loads in every tile (masked off in all but the few that hold a sequence's first tokens) the
program was 1168 SASS instructions at 148 registers (Triton 3.9; 1544 at 128 with 3.6); the tile kernel is now
608 at 60 (664 at 56 with 3.6). A branch around the tail loads instead cut the common path alike but took 3.6
to 168 registers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rnnserve.kernels.backend import int64_table, per_cu_seqlens, unit_stride_last
from rnnserve.kernels.selective_scan.fused_recurrent import silu_f32


@triton.jit
def _conv_taps(x_ptr, h0_ptr, w_ptr, seq, bos, pos, cols, mask_t, mask_c, stride_x, stride_h0_b, stride_h0_c,
               K: tl.constexpr, TAILS: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    """The ``[BT, BC]`` tile's sum over the ``K`` taps in fp32, tap by tap; a tap before its sequence's start
    reads the initial-state tail (``TAILS``) or 0."""
    acc = tl.zeros([BT, BC], dtype=tl.float32)
    for j in tl.static_range(K):
        src = pos - (K - 1) + j  # position of this tap's input within the sequence; < 0 reads the tail
        w = tl.load(w_ptr + cols * K + j, mask=mask_c, other=0.0).to(tl.float32)
        in_x = (mask_t & (src >= 0))[:, None] & mask_c[None, :]
        x_ptrs = x_ptr + (bos + src)[:, None] * stride_x + cols[None, :]
        tap = tl.load(x_ptrs, mask=in_x, other=0.0).to(tl.float32)
        if TAILS:
            in_tail = (mask_t & (src < 0))[:, None] & mask_c[None, :]
            tail_ptrs = h0_ptr + seq[:, None] * stride_h0_b + cols[None, :] * stride_h0_c
            tail_ptrs += (K - 1 + src)[:, None]
            tap += tl.load(tail_ptrs, mask=in_tail, other=0.0).to(tl.float32)
        acc += tap * w[None, :]
    return acc


@triton.jit
def _conv_output(acc, bias_ptr, cols, mask_c, out_dtype, HAS_BIAS: tl.constexpr, SILU: tl.constexpr):
    """The tile's output from its tap sums: plus the bias, then (``SILU``) ``F.silu`` of the value rounded to
    ``out_dtype``, in fp32 (:func:`silu_f32`: within 2 ulp before the output's rounding)."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=mask_c, other=0.0).to(tl.float32)[None, :]
    if SILU:
        acc = acc.to(out_dtype).to(tl.float32)
        acc = silu_f32(acc)
    return acc


@triton.jit(do_not_specialize=["total"])  # the batch's token count: one build for every batch, not three
def _conv_varlen_kernel(
    x_ptr, w_ptr, bias_ptr, h0_ptr, y_ptr, cu_seqlens_ptr, seq_idx_ptr, total, channels, stride_x,
    stride_h0_b, stride_h0_c,
    K: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_H0: tl.constexpr, SILU: tl.constexpr, BT: tl.constexpr,
    BC: tl.constexpr,
):
    rows = tl.program_id(0) * BT + tl.arange(0, BT).to(tl.int64)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    mask_t = rows < total
    mask_c = cols < channels
    seq = tl.load(seq_idx_ptr + rows, mask=mask_t, other=0).to(tl.int64)
    bos = tl.load(cu_seqlens_ptr + seq, mask=mask_t, other=0).to(tl.int64)
    pos = rows - bos
    acc = _conv_taps(x_ptr, h0_ptr, w_ptr, seq, bos, pos, cols, mask_t, mask_c, stride_x, stride_h0_b, stride_h0_c,
                     K, False, BT, BC)
    acc = _conv_output(acc, bias_ptr, cols, mask_c, y_ptr.dtype.element_ty, HAS_BIAS, SILU)
    if HAS_H0:  # a sequence's first K-1 outputs read its initial state: _conv_edges_kernel writes them
        mask_t &= pos >= K - 1
    tl.store(y_ptr + rows[:, None] * channels + cols[None, :], acc, mask=mask_t[:, None] & mask_c[None, :])


@triton.jit
def _conv_edges_kernel(
    x_ptr, w_ptr, bias_ptr, h0_ptr, y_ptr, ht_ptr, cu_seqlens_ptr, slot_ids_ptr, channels, stride_x, stride_h0_b,
    stride_h0_c, stride_ht_b, stride_ht_c,
    K: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_H0: tl.constexpr, HAS_SLOTS: tl.constexpr, SILU: tl.constexpr,
    BC: tl.constexpr, BK: tl.constexpr,
):
    i_b = tl.program_id(0)
    if HAS_SLOTS:  # the states are pool rows: the initial tail is read from, the final one written to, its slot
        row = tl.load(slot_ids_ptr + i_b).to(tl.int64)
    else:
        row = i_b.to(tl.int64)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    mask_c = cols < channels
    bos = tl.load(cu_seqlens_ptr + i_b).to(tl.int64)
    eos = tl.load(cu_seqlens_ptr + i_b + 1).to(tl.int64)
    k = tl.arange(0, BK)
    mask_k = k < K - 1
    if HAS_H0:  # the sequence's first K-1 outputs, whose taps reach into the initial state
        mask_t = mask_k & (bos + k < eos)
        seq = tl.zeros([BK], dtype=tl.int64) + row
        acc = _conv_taps(x_ptr, h0_ptr, w_ptr, seq, bos, k.to(tl.int64), cols, mask_t, mask_c, stride_x, stride_h0_b,
                         stride_h0_c, K, True, BK, BC)
        acc = _conv_output(acc, bias_ptr, cols, mask_c, y_ptr.dtype.element_ty, HAS_BIAS, SILU)
        tl.store(y_ptr + (bos + k)[:, None] * channels + cols[None, :], acc, mask=mask_t[:, None] & mask_c[None, :])
    # The final state: the sequence's last K-1 inputs, from the initial state where the sequence is shorter.
    src = (eos - bos) - (K - 1) + k
    in_x = mask_c[:, None] & (mask_k & (src >= 0))[None, :]
    x_ptrs = x_ptr + (bos + src)[None, :] * stride_x + cols[:, None]
    tail = tl.load(x_ptrs, mask=in_x, other=0.0).to(tl.float32)
    if HAS_H0:
        in_tail = mask_c[:, None] & (mask_k & (src < 0))[None, :]
        tail_ptrs = h0_ptr + row * stride_h0_b + cols[:, None] * stride_h0_c + (K - 1 + src)[None, :]
        tail += tl.load(tail_ptrs, mask=in_tail, other=0.0).to(tl.float32)
        # With slots the final tail overwrites the initial one: every thread's reads of it come first.
        tl.debug_barrier()
    out_ptrs = ht_ptr + row * stride_ht_b + cols[:, None] * stride_ht_c + k[None, :]
    tl.store(out_ptrs, tail, mask=mask_c[:, None] & mask_k[None, :])


def _sequence_ids(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Each packed token's sequence index (int64), built once per ``cu_seqlens`` tensor (a model's layers share
    it) from its host copy: no per-layer kernels, and no wait for the device in the engine, which attaches the
    host copy."""

    def build(bounds: list[int]) -> torch.Tensor:
        lengths = torch.tensor(bounds).diff()
        return int64_table(torch.repeat_interleave(torch.arange(lengths.numel()), lengths), cu_seqlens.device)

    return per_cu_seqlens(cu_seqlens, "conv_sequence_ids", build)


def causal_conv1d_varlen_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    silu: bool = False,
    slot_ids: torch.Tensor | None = None,
    block_t: int = 16,
    block_c: int = 128,
    num_warps: int = 4,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [T, C]``, ``weight [C, K]``, ``initial_state [B, C, K-1]`` -> ``(y [T, C], final [B, C, K-1])``.

    With ``slot_ids`` ``initial_state`` is a pool ``[num_slots, C, K-1]`` (fp32, unit stride on the tail; a
    per-layer view of a larger pool is fine) whose rows ``slot_ids`` are read and overwritten in place; the pool
    is returned as ``final``.

    ``x`` may have strided rows (a split of a projection: read in place). ``y`` (contiguous) has ``x``'s dtype
    (with ``silu``: ``F.silu`` of that rounded output), the final state is fp32. ``block_t`` tokens x
    ``block_c`` channels per program and ``num_warps`` set the launch (``benchmarks/conv_tune.py`` times them;
    H200, one layer at 16K tokens, 2048 / 2304 channels: 16 x 128 over 4 warps 71-93K tok/ms, the former
    32 x 64 over 8 warps 70-74K).
    """
    total, channels = x.shape
    width = weight.shape[1]
    if width < 2:
        raise ValueError("causal_conv1d needs a kernel width >= 2")
    batch = cu_seqlens.numel() - 1
    x, weight = unit_stride_last(x), weight.contiguous()
    if slot_ids is not None:
        if initial_state is None or initial_state.dtype != torch.float32 or initial_state.stride(-1) != 1:
            raise ValueError("slot_ids needs an fp32 state pool with a unit-stride tail")
        final_state = initial_state
        slot_ids = slot_ids.long().contiguous()
    else:
        if initial_state is not None and initial_state.stride(-1) != 1:
            initial_state = initial_state.contiguous()
        final_state = torch.empty(batch, channels, width - 1, dtype=torch.float32, device=x.device)
    seq_idx = _sequence_ids(cu_seqlens)
    y = torch.empty(total, channels, dtype=x.dtype, device=x.device)
    h0 = initial_state if initial_state is not None else final_state
    stride_b, stride_c = (h0.stride(0), h0.stride(1)) if initial_state is not None else (0, 0)
    tile_c = min(triton.next_power_of_2(channels), block_c)
    _conv_varlen_kernel[(triton.cdiv(total, block_t), triton.cdiv(channels, tile_c))](
        x, weight, bias if bias is not None else weight, h0, y, cu_seqlens, seq_idx, total, channels, x.stride(0),
        stride_b, stride_c, K=width, HAS_BIAS=bias is not None, HAS_H0=initial_state is not None, SILU=silu,
        BT=block_t, BC=tile_c, num_warps=num_warps,
    )
    _conv_edges_kernel[(batch, triton.cdiv(channels, tile_c))](
        x, weight, bias if bias is not None else weight, h0, y, final_state, cu_seqlens,
        slot_ids if slot_ids is not None else cu_seqlens, channels, x.stride(0), stride_b, stride_c,
        final_state.stride(0), final_state.stride(1), K=width, HAS_BIAS=bias is not None,
        HAS_H0=initial_state is not None, HAS_SLOTS=slot_ids is not None, SILU=silu, BC=tile_c,
        BK=triton.next_power_of_2(width - 1),
    )
    return y, final_state
