"""Triton decode step of a whole Mamba-2 stack for small batches: three kernels per layer, state in place.

Op by op a Mamba-2 layer's decode step is about a dozen launches (norm, in_proj, conv, SiLU, the dt and A
arithmetic, the SSD update, the gated norm, out_proj). Here it is three:

1. ``_mamba2_in_proj_kernel``, one program per ``BO`` rows of in_proj: the previous layer's residual add and this
   layer's RMSNorm, the rows as a GEMV, then by section: ``z`` rows stored, ``xBC`` rows through the causal conv
   update on the slots' tails and SiLU, ``dt`` rows stored.
2. ``_mamba2_ssm_kernel``, one program per (sequence, head, ``BP`` channels): ``dt = softplus(dt + dt_bias)``
   clamped, the slot's ``[BP, N]`` state rows advanced (read once, written once), ``y = S C + D x`` gated by
   ``silu(z)``, and the program's sum of squares of the gated ``y`` for the group norm.
3. ``_mamba2_out_proj_kernel``: the gated group RMSNorm (statistics from the partial sums) applied on the fly
   as out_proj's GEMV reads its input.

The rounding steps are the op-by-op step's (:func:`~rnnserve.kernels.mamba2_decode.naive.mamba2_mixer_step_ref`
between the conv and out_proj, the conv rounded to the activations' dtype before its SiLU as the op-by-op conv
without SiLU is); the GEMV helpers and the batch limit are :mod:`rnnserve.kernels.mamba_decode.fused_recurrent`'s,
the launch choices this module's own.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from rnnserve.kernels.mamba_decode import fused_recurrent as mamba1
from rnnserve.kernels.mamba_decode.fused_recurrent import (
    AHEAD_REQUESTS,
    conv_inputs,
    conv_update,
    dependent_launch,
    normed_input_times_weight,
    prefetch_conv_inputs,
    prefetch_share,
    prefetch_vector,
    prefetch_weight_rows,
    wait_for_previous_kernel,
    weight_lines,
    weight_tile,
)
from rnnserve.kernels.residual_rms_norm.fused import residual_rms_norm_triton
from rnnserve.kernels.selective_scan.fused_recurrent import softplus_f32

SSM_CHANNELS = 16  # channels of one head a program: [16, 128] state tiles at d_state 128
SSM_WARPS = 8
# Launch choices of this stack, as the Mamba-1 stack's (see there), measured by benchmarks/decode_tune.py on an
# H200 (mamba2-370m, bf16, CUDA graphs, batch 1, 2026-11-29, two rounds): 0.627 / 0.639 ms a step with these,
# 0.652 / 0.651 with 4 SSM warps, 0.835 / 0.848 with PREFETCH_INPUTS as well (the previous defaults), 1.89 ms op by
# op.
TILE = 4096
IN_PROJ_ROWS = 8
OUT_PROJ_ROWS = 2
OUT_PROJ_TILE = 4096  # out_proj's own TILE (see the Mamba-1 stack's)
NUM_WARPS = 4
LAUNCH_PDL = True
# Under dependent launch, also ask L2 for the norms' weights and the conv's tails and weights before the wait
# (the Mamba-1 stack's PREFETCH_INPUTS; the SSM kernel loads its parameters then anyway). Off: it cost ~4 us a
# layer on the H200, likely because every program asks for the whole norm weight vector, element by element
# (out_proj: 512 programs at 2 rows each, 2048 elements each), where the Mamba-1 stack has a quarter as many.
PREFETCH_INPUTS = False
# Load the GEMVs' first weight tiles and in_proj's conv tails and weights at the kernels' start, before the wait
# under dependent launch (the Mamba-1 stack's EARLY_LOADS; the SSM kernel does so always).
EARLY_LOADS = True
# Ask L2 from in_proj for its layer's out_proj weights, from the SSM kernel for the next layer's in_proj (the
# Mamba-1 stack's PREFETCH_AHEAD).
PREFETCH_AHEAD = False
# One persistent launch a step (persistent.py: a program per SM at most, the three kernels' work items phase by
# phase between grid barriers, then the final norm) instead of three kernels a layer and the final norm's. Off:
# unmeasured on a GPU (tested under the interpreter and compiled for sm_90 only); decode_tune sweeps it.
PERSISTENT = False


@triton.jit
def in_proj_item(
    pid, programs, x_ptr, stream_ptr, delta_ptr, norm_w_ptr, new_stream_ptr, w_ptr, bias_ptr,
    conv_pool_ptr, conv_w_ptr, conv_b_ptr, slot_ids_ptr, z_ptr, xbc_ptr, dt_ptr, ahead_ptr,
    batch, d_model, d_inner, conv_dim, heads, eps, stride_conv_slot, stride_conv_d, n_ahead,
    HAS_NORM: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_CONV_BIAS: tl.constexpr, K: tl.constexpr,
    BB: tl.constexpr, BO: tl.constexpr, BK: tl.constexpr, BKC: tl.constexpr, PDL: tl.constexpr,
    LINES: tl.constexpr, PREFETCH: tl.constexpr, EARLY: tl.constexpr, AHEAD: tl.constexpr, CACHE: tl.constexpr = "",
):
    """Work item ``pid`` of in_proj (of ``programs``, which share ``PREFETCH_AHEAD``'s requests): output rows
    ``pid * BO`` to ``pid * BO + BO``, with the norm before and the conv, SiLU and stores after (see the module
    docstring). Item 0 stores the new residual stream. ``CACHE``: the cache modifier of the loads of what an
    earlier kernel or phase wrote (the input rows, the stream, out_proj's output)."""
    first = pid * BO
    rows = tl.arange(0, BB)
    row_ok = rows < batch
    outs = first + tl.arange(0, BO)
    out_ok = outs < d_inner + conv_dim + heads
    chans = outs - d_inner
    is_xbc = (outs >= d_inner) & (chans < conv_dim)
    if EARLY:
        w_first = weight_tile(w_ptr, outs, out_ok, 0, d_model, BK)
        tail_ptrs, window, shifted, conv_w, conv_b = conv_inputs(
            chans, is_xbc, rows, row_ok, slot_ids_ptr, conv_pool_ptr, conv_w_ptr, conv_b_ptr, stride_conv_slot,
            stride_conv_d, HAS_CONV_BIAS, K, BKC)
    if PDL:  # while the previous kernel runs: what no kernel of this step writes (and is not loaded yet), into L2
        if (not EARLY) or (BK < d_model):
            prefetch_weight_rows(w_ptr, first, d_inner + conv_dim + heads, d_model, BO, LINES)
        if PREFETCH:
            if HAS_NORM:
                prefetch_vector(norm_w_ptr, d_model)
            if not EARLY:
                if (first + BO > d_inner) & (first < d_inner + conv_dim):
                    prefetch_conv_inputs(tl.minimum(tl.maximum(chans, 0), conv_dim - 1), rows, row_ok, slot_ids_ptr,
                                         conv_pool_ptr, conv_w_ptr, conv_b_ptr, stride_conv_slot, stride_conv_d,
                                         HAS_CONV_BIAS, K)
        wait_for_previous_kernel()
    if not EARLY:
        w_first = weight_tile(w_ptr, outs, out_ok, 0, d_model, BK)
    wdtype = w_ptr.dtype.element_ty
    projected = normed_input_times_weight(
        x_ptr, stream_ptr, delta_ptr, norm_w_ptr, new_stream_ptr, w_ptr, bias_ptr, w_first, pid, outs, out_ok,
        rows, row_ok, d_model, eps, HAS_NORM, HAS_BIAS, BB, BO, BK, CACHE,
    )
    tl.store(z_ptr + rows[:, None] * d_inner + outs[None, :], projected.to(wdtype),
             mask=row_ok[:, None] & (outs < d_inner)[None, :])
    if not EARLY:
        tail_ptrs, window, shifted, conv_w, conv_b = conv_inputs(
            chans, is_xbc, rows, row_ok, slot_ids_ptr, conv_pool_ptr, conv_w_ptr, conv_b_ptr, stride_conv_slot,
            stride_conv_d, HAS_CONV_BIAS, K, BKC)
    xbc = conv_update(projected, tail_ptrs, window, shifted, conv_w, conv_b, is_xbc, row_ok, HAS_CONV_BIAS, K, BKC)
    xbc = xbc.to(wdtype).to(tl.float32)  # the conv's output, then its SiLU, each in the activations' dtype
    tl.store(xbc_ptr + rows[:, None] * conv_dim + chans[None, :], (xbc * tl.sigmoid(xbc)).to(wdtype),
             mask=row_ok[:, None] & is_xbc[None, :])
    dt_heads = chans - conv_dim
    tl.store(dt_ptr + rows[:, None] * heads + dt_heads[None, :], projected.to(wdtype),
             mask=row_ok[:, None] & ((dt_heads >= 0) & (dt_heads < heads))[None, :])
    if AHEAD:  # this layer's out_proj, after this program's own work
        prefetch_share(ahead_ptr, n_ahead, pid, programs, AHEAD_REQUESTS)


@triton.jit
def _mamba2_in_proj_kernel(
    x_ptr, stream_ptr, delta_ptr, norm_w_ptr, new_stream_ptr, w_ptr, bias_ptr,
    conv_pool_ptr, conv_w_ptr, conv_b_ptr, slot_ids_ptr, z_ptr, xbc_ptr, dt_ptr, ahead_ptr,
    batch, d_model, d_inner, conv_dim, heads, eps, stride_conv_slot, stride_conv_d, n_ahead,
    HAS_NORM: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_CONV_BIAS: tl.constexpr, K: tl.constexpr,
    BB: tl.constexpr, BO: tl.constexpr, BK: tl.constexpr, BKC: tl.constexpr, PDL: tl.constexpr,
    LINES: tl.constexpr, PREFETCH: tl.constexpr, EARLY: tl.constexpr, AHEAD: tl.constexpr,
):
    in_proj_item(
        tl.program_id(0), tl.num_programs(0), x_ptr, stream_ptr, delta_ptr, norm_w_ptr, new_stream_ptr, w_ptr,
        bias_ptr, conv_pool_ptr, conv_w_ptr, conv_b_ptr, slot_ids_ptr, z_ptr, xbc_ptr, dt_ptr, ahead_ptr, batch,
        d_model, d_inner, conv_dim, heads, eps, stride_conv_slot, stride_conv_d, n_ahead, HAS_NORM, HAS_BIAS,
        HAS_CONV_BIAS, K, BB, BO, BK, BKC, PDL, LINES, PREFETCH, EARLY, AHEAD,
    )


@triton.jit
def ssm_item(
    b, head, i_p, batch, p_blocks, xbc_ptr, dt_ptr, z_ptr, dt_bias_ptr, A_log_ptr, D_ptr, ssm_pool_ptr,
    slot_ids_ptr, gated_ptr, squares_ptr, ahead_ptr, d_inner, conv_dim, heads, head_dim, d_state, heads_per_group,
    groups, dt_min, dt_max, stride_ssm_slot, stride_ssm_h, stride_ssm_p, n_ahead,
    BP: tl.constexpr, BN: tl.constexpr, PDL: tl.constexpr, AHEAD: tl.constexpr, CACHE: tl.constexpr,
):
    """The SSM's work item (sequence ``b`` of ``batch``, ``head``, channel block ``i_p`` of ``p_blocks``), its
    loads of what in_proj wrote with ``CACHE`` (a load cache modifier)."""
    group = head // heads_per_group
    chans = i_p * BP + tl.arange(0, BP)
    chan_ok = chans < head_dim
    states = tl.arange(0, BN)
    state_ok = states < d_state
    # What no earlier kernel of this step writes first (parameters, the slot's state rows), then the rest.
    dt_bias = tl.load(dt_bias_ptr + head).to(tl.float32)
    A = -tl.exp(tl.load(A_log_ptr + head).to(tl.float32))
    D = tl.load(D_ptr + head).to(tl.float32)
    slot = tl.load(slot_ids_ptr + b).to(tl.int64)
    ok = chan_ok[:, None] & state_ok[None, :]
    state_ptrs = (ssm_pool_ptr + slot * stride_ssm_slot + head * stride_ssm_h + chans[:, None] * stride_ssm_p
                  + states[None, :])
    s = tl.load(state_ptrs, mask=ok, other=0.0)
    if PDL:
        wait_for_previous_kernel()
    row = xbc_ptr + b * conv_dim
    x = tl.load(row + head * head_dim + chans, mask=chan_ok, other=0.0, cache_modifier=CACHE).to(tl.float32)
    B = tl.load(row + d_inner + group * d_state + states, mask=state_ok, other=0.0,
                cache_modifier=CACHE).to(tl.float32)
    C = tl.load(row + d_inner + (groups + group) * d_state + states, mask=state_ok, other=0.0,
                cache_modifier=CACHE).to(tl.float32)
    dt = tl.load(dt_ptr + b * heads + head, cache_modifier=CACHE).to(tl.float32) + dt_bias
    # torch's clamp keeps a NaN step size; tl.maximum / tl.minimum drop NaN unless told (a max.NaN, the same one
    # instruction on sm_90), which made the head's state and output finite where the op-by-op step has NaN.
    dt = tl.maximum(softplus_f32(dt), dt_min, propagate_nan=tl.PropagateNan.ALL)
    dt = tl.minimum(dt, dt_max, propagate_nan=tl.PropagateNan.ALL)
    decay = tl.exp(A * dt)
    s = decay * s + (dt * x)[:, None] * B[None, :]
    tl.store(state_ptrs, s, mask=ok)
    y = tl.sum(s * C[None, :], axis=1) + D * x
    z = tl.load(z_ptr + b * d_inner + head * head_dim + chans, mask=chan_ok, other=0.0,
                cache_modifier=CACHE).to(tl.float32)
    gated = tl.where(chan_ok, y * (z * tl.sigmoid(z)), 0.0)  # y silu(z): y z overflows first
    tl.store(gated_ptr + b * d_inner + head * head_dim + chans, gated, mask=chan_ok)
    parts = heads * p_blocks
    tl.store(squares_ptr + b * parts + head * p_blocks + i_p, tl.sum(gated * gated, axis=0))
    if AHEAD:  # the next layer's in_proj, after this program's own work
        prefetch_share(ahead_ptr, n_ahead, (b * heads + head) * p_blocks + i_p, batch * parts, AHEAD_REQUESTS)


@triton.jit
def _mamba2_ssm_kernel(
    xbc_ptr, dt_ptr, z_ptr, dt_bias_ptr, A_log_ptr, D_ptr, ssm_pool_ptr, slot_ids_ptr, gated_ptr, squares_ptr,
    ahead_ptr, d_inner, conv_dim, heads, head_dim, d_state, heads_per_group, groups, dt_min, dt_max,
    stride_ssm_slot, stride_ssm_h, stride_ssm_p, n_ahead,
    BP: tl.constexpr, BN: tl.constexpr, PDL: tl.constexpr, AHEAD: tl.constexpr,
):
    ssm_item(
        tl.program_id(0), tl.program_id(1), tl.program_id(2), tl.num_programs(0), tl.num_programs(2), xbc_ptr,
        dt_ptr, z_ptr, dt_bias_ptr, A_log_ptr, D_ptr, ssm_pool_ptr, slot_ids_ptr, gated_ptr, squares_ptr, ahead_ptr,
        d_inner, conv_dim, heads, head_dim, d_state, heads_per_group, groups, dt_min, dt_max, stride_ssm_slot,
        stride_ssm_h, stride_ssm_p, n_ahead, BP, BN, PDL, AHEAD, "",
    )


@triton.jit
def gated_input_tile(gated_ptr, norm_w_ptr, w_ptr, rstd, rows, row_ok, group_ids, k0, d_inner, group_width,
                     BK: tl.constexpr, CACHE: tl.constexpr):
    """Columns ``k0`` to ``k0 + BK`` of out_proj's input: the gated ``y`` through the group norm (``rstd [BB,
    BG]``), ``[BB, BK]`` fp32 holding values of the weights' dtype (``y`` loaded with ``CACHE``)."""
    wdtype = w_ptr.dtype.element_ty
    cols = k0 + tl.arange(0, BK)
    col_ok = cols < d_inner
    g = tl.load(gated_ptr + rows[:, None] * d_inner + cols[None, :], mask=row_ok[:, None] & col_ok[None, :],
                other=0.0, cache_modifier=CACHE)
    of_group = (cols // group_width)[:, None] == group_ids[None, :]
    col_rstd = tl.sum(tl.where(of_group[None, :, :], rstd[:, None, :], 0.0), axis=2)
    normed = (g * col_rstd).to(wdtype).to(tl.float32)
    nw = tl.load(norm_w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    return (nw[None, :] * normed).to(wdtype).to(tl.float32)


@triton.jit
def out_proj_item(
    pid, gated_ptr, squares_ptr, norm_w_ptr, w_ptr, bias_ptr, out_ptr, batch, d_inner, d_model, parts,
    parts_per_group, group_width, eps,
    HAS_BIAS: tl.constexpr, BB: tl.constexpr, BO: tl.constexpr, BK: tl.constexpr, BQ: tl.constexpr,
    BG: tl.constexpr, PDL: tl.constexpr, LINES: tl.constexpr, PREFETCH: tl.constexpr, EARLY: tl.constexpr,
    CACHE: tl.constexpr,
):
    """Work item ``pid`` of out_proj: output columns ``pid * BO`` to ``pid * BO + BO``, the group norm's
    statistics and input read with ``CACHE`` (a load cache modifier)."""
    outs = pid * BO + tl.arange(0, BO)
    out_ok = outs < d_model
    if EARLY:
        w_first = weight_tile(w_ptr, outs, out_ok, 0, d_inner, BK)
    if PDL:
        if (not EARLY) or (BK < d_inner):
            prefetch_weight_rows(w_ptr, pid * BO, d_model, d_inner, BO, LINES)
        if PREFETCH:
            prefetch_vector(norm_w_ptr, d_inner)
        wait_for_previous_kernel()
    if not EARLY:
        w_first = weight_tile(w_ptr, outs, out_ok, 0, d_inner, BK)
    rows = tl.arange(0, BB)
    row_ok = rows < batch
    # Each group's statistics from the SSM programs' sums of squares: [BB, BG].
    part = tl.arange(0, BQ)
    group_ids = tl.arange(0, BG)
    squares = tl.load(squares_ptr + rows[:, None] * parts + part[None, :],
                      mask=row_ok[:, None] & (part < parts)[None, :], other=0.0, cache_modifier=CACHE)
    in_group = (part // parts_per_group)[:, None] == group_ids[None, :]
    sums = tl.sum(tl.where(in_group[None, :, :], squares[:, :, None], 0.0), axis=1)
    rstd = tl.rsqrt(sums / group_width + eps)
    x = gated_input_tile(gated_ptr, norm_w_ptr, w_ptr, rstd, rows, row_ok, group_ids, 0, d_inner, group_width, BK,
                         CACHE)
    acc = x[:, None, :] * w_first.to(tl.float32)[None, :, :]  # summed over K once, after the loop
    for k0 in range(BK, d_inner, BK):
        x = gated_input_tile(gated_ptr, norm_w_ptr, w_ptr, rstd, rows, row_ok, group_ids, k0, d_inner, group_width,
                             BK, CACHE)
        w = weight_tile(w_ptr, outs, out_ok, k0, d_inner, BK)
        acc += x[:, None, :] * w.to(tl.float32)[None, :, :]
    acc = tl.sum(acc, axis=2)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + outs, mask=out_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows[:, None] * d_model + outs[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & out_ok[None, :])


@triton.jit
def _mamba2_out_proj_kernel(
    gated_ptr, squares_ptr, norm_w_ptr, w_ptr, bias_ptr, out_ptr, batch, d_inner, d_model, parts, parts_per_group,
    group_width, eps,
    HAS_BIAS: tl.constexpr, BB: tl.constexpr, BO: tl.constexpr, BK: tl.constexpr, BQ: tl.constexpr,
    BG: tl.constexpr, PDL: tl.constexpr, LINES: tl.constexpr, PREFETCH: tl.constexpr, EARLY: tl.constexpr,
):
    out_proj_item(
        tl.program_id(0), gated_ptr, squares_ptr, norm_w_ptr, w_ptr, bias_ptr, out_ptr, batch, d_inner, d_model,
        parts, parts_per_group, group_width, eps, HAS_BIAS, BB, BO, BK, BQ, BG, PDL, LINES, PREFETCH, EARLY, "",
    )


def mamba2_decode_stack_triton(
    normed: torch.Tensor,
    stream: torch.Tensor,
    norm_weights: Sequence[torch.Tensor],
    eps: float,
    layers: Sequence[Sequence[torch.Tensor | None]],
    conv_pool: torch.Tensor,
    ssm_pool: torch.Tensor,
    slot_ids: torch.Tensor,
    groups: int,
    gated_eps: float,
    dt_limits: tuple[float, float],
) -> torch.Tensor:
    """Every layer of a Mamba-2 decode step of at most ``MAX_ROWS`` (8) sequences; returns the final norm's
    output ``[B, d_model]``.

    ``normed``/``stream``: the first block's input and the residual stream; ``norm_weights[i]``: block ``i + 1``'s
    norm, the last one the final norm's; ``layers[i]``: ``(in_proj_weight, in_proj_bias, conv_weight [conv_dim,
    K], conv_bias, dt_bias, A_log, D, gated_norm_weight, out_proj_weight, out_proj_bias)`` as the model holds them;
    ``groups``, ``gated_eps`` and ``dt_limits``: the gated norm's groups and epsilon and dt's clamp.
    ``conv_pool [N, L, conv_dim, K-1]`` and ``ssm_pool [N, L, H, P, Ns]`` fp32, unit stride on the last
    dimension, advanced in place at rows ``slot_ids``.
    """
    batch, d_model = normed.shape
    if not 1 <= batch <= mamba1.MAX_ROWS:
        raise ValueError(f"the Triton decode stack takes 1 to {mamba1.MAX_ROWS} rows, got {batch}")
    heads, head_dim, d_state = ssm_pool.shape[2:]
    d_inner = heads * head_dim
    dtype, device = layers[0][0].dtype, normed.device
    conv_dim, width = layers[0][2].shape[0], layers[0][2].shape[-1]
    n_out = d_inner + conv_dim + heads
    batch_block = mamba1.pow2(batch)
    pdl = dependent_launch(LAUNCH_PDL, normed.device)
    block_o, block_k = mamba1.gemv_blocks(batch_block, d_model, IN_PROJ_ROWS, TILE)  # may straddle z / xBC / dt
    block_p = min(SSM_CHANNELS, mamba1.pow2(head_dim))
    p_blocks = triton.cdiv(head_dim, block_p)
    parts = heads * p_blocks
    out_block_o, out_block_k = mamba1.gemv_blocks(batch_block, d_inner, OUT_PROJ_ROWS, OUT_PROJ_TILE)
    slot_ids = slot_ids.long().contiguous()
    z = torch.empty(batch, d_inner, dtype=dtype, device=device)
    xbc = torch.empty(batch, conv_dim, dtype=dtype, device=device)
    dt = torch.empty(batch, heads, dtype=dtype, device=device)
    gated = torch.empty(batch, d_inner, dtype=torch.float32, device=device)
    squares = torch.empty(batch, parts, dtype=torch.float32, device=device)
    streams = (torch.empty_like(stream), torch.empty_like(stream))
    normed, stream = normed.contiguous(), stream.contiguous()
    delta = None
    ahead = pdl and PREFETCH_AHEAD  # the requests are inline PTX, run where dependent launch is
    for i, layer in enumerate(layers):
        in_w, in_b, conv_w, conv_b, dt_bias, A_log, D, gated_w, out_w, out_b = (
            None if t is None else t.contiguous() for t in layer
        )
        has_next = i + 1 < len(layers)
        next_in_w = layers[i + 1][0].contiguous() if has_next else in_w  # in_w: a placeholder, not asked for
        conv, ssm = conv_pool[:, i], ssm_pool[:, i]
        new_stream = streams[i % 2]
        _mamba2_in_proj_kernel[(triton.cdiv(n_out, block_o),)](
            normed, stream, delta if delta is not None else normed, norm_weights[i - 1], new_stream, in_w,
            in_b if in_b is not None else in_w, conv, conv_w, conv_b if conv_b is not None else conv_w, slot_ids,
            z, xbc, dt, out_w, batch, d_model, d_inner, conv_dim, heads, eps, conv.stride(0), conv.stride(1),
            out_w.numel(), HAS_NORM=delta is not None, HAS_BIAS=in_b is not None, HAS_CONV_BIAS=conv_b is not None,
            K=width, BB=batch_block, BO=block_o, BK=block_k, BKC=mamba1.pow2(width), PDL=pdl,
            LINES=weight_lines(in_w, block_o), PREFETCH=PREFETCH_INPUTS, EARLY=EARLY_LOADS,
            AHEAD=ahead, num_warps=NUM_WARPS, launch_pdl=pdl,
        )
        if delta is not None:
            stream = new_stream
        _mamba2_ssm_kernel[(batch, heads, p_blocks)](
            xbc, dt, z, dt_bias, A_log, D, ssm, slot_ids, gated, squares, next_in_w, d_inner, conv_dim, heads,
            head_dim, d_state, heads // groups, groups, dt_limits[0], dt_limits[1], ssm.stride(0), ssm.stride(1),
            ssm.stride(2), next_in_w.numel(), BP=block_p, BN=mamba1.pow2(d_state), PDL=pdl,
            AHEAD=ahead and has_next, num_warps=SSM_WARPS, launch_pdl=pdl,
        )
        delta = torch.empty(batch, d_model, dtype=dtype, device=device)
        _mamba2_out_proj_kernel[(triton.cdiv(d_model, out_block_o),)](
            gated, squares, gated_w, out_w, out_b if out_b is not None else out_w, delta, batch, d_inner, d_model,
            parts, parts // groups, d_inner // groups, gated_eps,
            HAS_BIAS=out_b is not None, BB=batch_block, BO=out_block_o, BK=out_block_k, BQ=mamba1.pow2(parts),
            BG=mamba1.pow2(groups), PDL=pdl, LINES=weight_lines(out_w, out_block_o), PREFETCH=PREFETCH_INPUTS,
            EARLY=EARLY_LOADS, num_warps=NUM_WARPS, launch_pdl=pdl,
        )
    normed, _ = residual_rms_norm_triton(stream, delta, norm_weights[-1], eps, False)
    return normed


__all__ = ["mamba2_decode_stack_triton"]
