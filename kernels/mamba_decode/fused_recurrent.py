"""Triton decode step of a whole Mamba-1 stack for small batches: three kernels per layer, state in place.

At batch 1 a decode step streams the weights once; op by op a layer is eight small launches (norm, in_proj,
conv, x_proj, dt_proj, scan, cast, out_proj), each paying a launch and a tail. Here a layer is three:

1. ``_mamba_in_proj_kernel``, one program per ``BO`` rows of in_proj: the previous layer's residual add and this
   layer's RMSNorm (recomputed per program from the ``[B, d_model]`` stream, which is small), the in_proj rows
   as a GEMV, and for ``x`` rows the causal conv update on the slots' conv tails, SiLU, and the program's share
   of x_proj (``x_proj[:, block] @ x[block]``, one partial sum per program); ``z`` rows are stored.
2. ``_mamba_ssm_kernel``, one program per (sequence, ``BC`` channels): sums the x_proj partials into
   ``(dt, B, C)``, applies dt_proj to its channels, advances the slot's ``[BC, N]`` state rows (read once,
   written once) and emits ``y = (C . h + D x) * silu(z)``.
3. ``_mamba_out_proj_kernel``: out_proj as a GEMV.

Each rounding of the op-by-op step (:func:`~rnnserve.kernels.mamba_decode.naive.mamba_mixer_decode_ref` with
:func:`~rnnserve.kernels.residual_rms_norm.naive.residual_rms_norm_ref`) happens at the same point in the same
dtype: the normed input, the projections' outputs, the conv output and ``y`` in the weights' dtype, the stream
in its own. Products accumulate in fp32 as broadcast multiply-and-sum (no ``tl.dot``: with at most
:data:`MAX_ROWS` rows, tensor-core tiles would be mostly padding, and the weight stream is the cost).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from rnnserve.kernels.residual_rms_norm.fused import residual_rms_norm_triton
from rnnserve.kernels.selective_scan.fused_recurrent import softplus_f32

# Launch choices of this stack (the Mamba-2 stack has its own), measured by benchmarks/decode_tune.py on an H200
# (mamba-370m, bf16, CUDA graphs, batch 1, 2026-11-29, two rounds): 0.684 / 0.683 ms a step with these, 0.705 /
# 0.709 with 8 out_proj rows (the previous default), 1.67 ms op by op; 4 warps gained another 0.5% in bf16 but
# spill in fp32. 32 in_proj rows a program also halve the x_proj partial sums each SSM program adds up. A GEMV
# program's loads in one loop step are all it has in flight (Triton pipelines loads that feed tl.dot, not these),
# so steps are long and programs many.
MAX_ROWS = 8  # the most rows the stacks take (the models use them up to their packages' STACK_MAX_BATCH)
TILE = 16384  # elements of a program's multiply-and-sum product per loop step
IN_PROJ_ROWS = 32  # in_proj rows a program (at most; a power of two dividing d_inner)
OUT_PROJ_ROWS = 4
# out_proj's own TILE. Under dependent launch the next layer's in_proj programs start (and prefetch their rows)
# only on SMs with registers to spare beside an out_proj program: at batch 1 in bf16, in_proj takes 149 registers
# a thread at 8 warps (38.9K of an SM's 64K), out_proj 148 at this tile and 86 at 8192 (22.5K), so only the
# smaller tile lets them share an SM. Measured on the H200: no gain (0.718 ms a step at 8192, 0.713 at 16384).
OUT_PROJ_TILE = 16384
SSM_CHANNELS = 64
NUM_WARPS = 8  # the GEMV kernels'
SSM_WARPS = 4
# Programmatic dependent launch (sm_90): each stack kernel may start while the one before it runs, asking L2 for
# the weights (or loading the state rows) only it reads, then waits for it (wait_for_previous_kernel). On an H200
# it made every launch shape decode_tune swept faster at batch 1 (by 1-10%, both stacks; here 1.02 -> 0.95 ms).
LAUNCH_PDL = True
# Under dependent launch, also ask L2 for the small inputs each kernel reads after its wait that no kernel of
# the step writes: the norm's weights, the conv's tails and weights and x_proj's columns (in_proj), dt_proj,
# A, D and dt's bias (the SSM kernel). Read after the GEMV or the partial sums, each was a trip to HBM on the
# layer's critical path. Measured on the H200: no difference (0.714 ms off, 0.713 on).
PREFETCH_INPUTS = True
# Load into registers, at a kernel's start, every input no kernel of the step writes and the kernel reads in its
# first pass: each GEMV's first weight tile, in_proj's conv tails, conv weights and first x_proj columns, the SSM
# kernel's dt_proj rows, A, D and dt's bias. Under dependent launch that is before the wait, while the kernel
# before runs; either way those loads are in flight together with the first ones that depend on it (the
# residual stream, the partial sums) instead of after them, so each kernel waits on memory about once after its
# start, not two to five times in a row. (PREFETCH_INPUTS then only covers what is left.) On the H200: 0.713 ms
# a step with them, 0.828 without.
EARLY_LOADS = True
# Under dependent launch, also ask L2 from each kernel for the weights of a later one: in_proj for its layer's
# out_proj, the SSM kernel for the next layer's in_proj. Each kernel's own request comes only once its programs
# are resident, which beside the kernel before it takes registers to spare; these come from a kernel that runs,
# after its own work, so the weights stream from HBM in the background of the step. Off: the requests could
# also queue ahead of the next kernels' own loads, and on the H200 they did: 0.871 ms a step with them, 0.713
# without.
PREFETCH_AHEAD = False
# One launch a step (persistent.py, mamba_decode_stack_persistent): a grid of at most one program per SM walks every
# layer's three phases and the final norm, meeting at grid_barrier between phases, instead of three launches a layer
# (each ~14 us of launch and tail against ~3 us of weight stream at batch 1 on the H200). Off: not yet measured on
# a GPU (benchmarks/decode_tune.py sweeps it, which scripts/gpu_check.sh runs).
PERSISTENT = False
L2_LINE = tl.constexpr(128)  # bytes
AHEAD_REQUESTS = tl.constexpr(1024)  # L2 requests a program issues at a time for PREFETCH_AHEAD
VECTOR_REQUESTS = tl.constexpr(64)  # ... and for a vector of inputs (prefetch_vector)


@triton.jit
def wait_for_previous_kernel():
    """Under programmatic dependent launch: wait until the previous kernel completed (its outputs are this
    one's inputs, and nothing it reads may be overwritten before), then let the next kernel launch."""
    tl.extra.cuda.gdc_wait()
    tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def grid_barrier(counter_ptr, arrivals):
    """Wait until the int32 counter at ``counter_ptr`` reaches ``arrivals`` after adding this program's arrival.

    A grid-wide barrier for a persistent launch, whose programs must all be resident at once (a grid of at most
    one program per SM where one fits): every program passes the same barriers in the same order, the k-th with
    ``arrivals = k * num_programs``, on a counter zeroed before the launch. The arrival is a release and the wait
    an acquire at GPU scope, each program's threads meeting before and after, so what any program stored before
    the barrier is what every program loads after it, provided those loads bypass L1 (``cache_modifier=".cg"``:
    L1 is not coherent between SMs). Not for the interpreter, which runs programs one after another.
    """
    tl.debug_barrier()
    tl.atomic_add(counter_ptr, 1, sem="release", scope="gpu")
    count = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    while count < arrivals:
        count = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def prefetch_l2(ptrs):
    """Ask L2 for the line of each address in ``ptrs`` (valid addresses; lanes of a warp that share a line make
    one request). Inline PTX: only where the stacks launch with programmatic dependent launch (not the
    interpreter)."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def prefetch_weight_rows(w_ptr, first_row, n_rows, row_len, BO: tl.constexpr, LINES: tl.constexpr):
    """Ask L2 for a GEMV program's weight rows ``first_row`` to ``first_row + BO`` (of ``n_rows`` rows of
    ``row_len``, contiguous; one line a lane, at most ``LINES`` lines)."""
    line = L2_LINE // (w_ptr.dtype.element_ty.primitive_bitwidth // 8)
    n_elements = (tl.minimum(first_row + BO, n_rows) - first_row) * row_len
    offsets = tl.minimum(tl.arange(0, LINES) * line, n_elements - 1)
    prefetch_l2(w_ptr + first_row.to(tl.int64) * row_len + offsets)


@triton.jit
def prefetch_row_spans(ptr, rows, row_stride, span):
    """Ask L2 for ``ptr[r * row_stride : r * row_stride + span]`` for each ``r`` in ``rows`` (valid rows): the
    lines of each span's first and last element, all of a span of up to two lines."""
    starts = ptr + rows.to(tl.int64) * row_stride
    prefetch_l2(starts)
    prefetch_l2(starts + (span - 1))


@triton.jit
def prefetch_share(ptr, n_elements, part, parts, REQUESTS: tl.constexpr):
    """Ask L2 for share ``part`` of ``parts`` of the lines of ``ptr[:n_elements]`` (``n_elements > 0``), e.g. a
    later kernel's weights, asked for by the programs of one that runs before it. One request per line's worth of
    elements and one for the last element (whose line is one more where ``ptr`` does not start a line),
    ``REQUESTS`` at a time."""
    line = L2_LINE // (ptr.dtype.element_ty.primitive_bitwidth // 8)
    n_requests = tl.cdiv(n_elements, line) + 1
    per_part = tl.cdiv(n_requests, parts)
    first = part * per_part
    last = tl.minimum(first + per_part, n_requests) - 1
    for r0 in range(first, last + 1, REQUESTS):
        requests = tl.minimum(r0 + tl.arange(0, REQUESTS), last)
        prefetch_l2(ptr + tl.minimum(requests.to(tl.int64) * line, n_elements - 1))


@triton.jit
def prefetch_vector(ptr, n):
    """Ask L2 for the lines of ``ptr[:n]`` (``n > 0``), a line a request (:func:`prefetch_share`, all of it).
    Every program of a GEMV asks for the same vector (a norm's weights), so a request per element (the first
    version) made each line's requests as many as its elements: on an H200 that cost the Mamba-2 stack ~4 us a
    layer."""
    prefetch_share(ptr, n, 0, 1, VECTOR_REQUESTS)


@triton.jit
def prefetch_conv_inputs(
    chans, rows, row_ok, slot_ids_ptr, conv_pool_ptr, conv_w_ptr, conv_b_ptr, stride_conv_slot, stride_conv_d,
    HAS_CONV_BIAS: tl.constexpr, K: tl.constexpr,
):
    """Ask L2 for what :func:`conv_update` reads of channels ``chans`` (valid channels): the slots' tails, the
    conv's weights and bias."""
    slots = tl.load(slot_ids_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    tails = conv_pool_ptr + slots[:, None] * stride_conv_slot + chans[None, :].to(tl.int64) * stride_conv_d
    prefetch_l2(tails)
    prefetch_l2(tails + (K - 2))
    prefetch_row_spans(conv_w_ptr, chans, K, K)
    if HAS_CONV_BIAS:
        prefetch_l2(conv_b_ptr + chans)


@triton.jit
def weight_tile(w_ptr, outs, out_ok, k0, n_in, BK: tl.constexpr):
    """Columns ``k0`` to ``k0 + BK`` of the weight rows ``outs`` of ``n_in`` columns: ``[BO, BK]``, zeros past
    either end."""
    cols = k0 + tl.arange(0, BK)
    return tl.load(w_ptr + outs[:, None].to(tl.int64) * n_in + cols[None, :],
                   mask=out_ok[:, None] & (cols < n_in)[None, :], other=0.0)


@triton.jit
def gemv_input_tile(
    x_ptr, stream_ptr, delta_ptr, norm_w_ptr, w_ptr, rstd, rows, row_ok, k0, d_model, HAS_NORM: tl.constexpr,
    BK: tl.constexpr,
):
    """Columns ``k0`` to ``k0 + BK`` of :func:`normed_input_times_weight`'s input rows, ``[BB, BK]`` fp32 holding
    values of the weights' dtype."""
    wdtype = w_ptr.dtype.element_ty
    cols = k0 + tl.arange(0, BK)
    ok = row_ok[:, None] & (cols < d_model)[None, :]
    offs = rows[:, None] * d_model + cols[None, :]
    if HAS_NORM:
        sdtype = stream_ptr.dtype.element_ty
        s = tl.load(stream_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        d = tl.load(delta_ptr + offs, mask=ok, other=0.0).to(sdtype).to(tl.float32)
        s = (s + d).to(sdtype).to(wdtype).to(tl.float32)
        y = (s * rstd[:, None]).to(wdtype).to(tl.float32)
        nw = tl.load(norm_w_ptr + cols, mask=cols < d_model, other=0.0).to(tl.float32)
        x = (nw[None, :] * y).to(wdtype).to(tl.float32)
    else:
        x = tl.load(x_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    return x


@triton.jit
def normed_input_times_weight(
    x_ptr, stream_ptr, delta_ptr, norm_w_ptr, new_stream_ptr, w_ptr, bias_ptr, w_first, pid, outs, out_ok, rows,
    row_ok, d_model, eps, HAS_NORM: tl.constexpr, HAS_BIAS: tl.constexpr, BB: tl.constexpr, BO: tl.constexpr,
    BK: tl.constexpr,
):
    """``[BB, BO]`` fp32, rounded to the weights' dtype: a block's input rows times weight rows ``outs`` (+ bias).

    With ``HAS_NORM`` the input is ``RMSNorm(stream + delta)`` computed here, with the rounding steps of
    :func:`~rnnserve.kernels.residual_rms_norm.naive.residual_rms_norm_ref` (program 0 also stores the new
    stream); else the rows of ``x_ptr``, already normed. ``w_first``: the rows' first tile (:func:`weight_tile`
    at 0), which the caller loads (early: see ``EARLY_LOADS``)."""
    wdtype = w_ptr.dtype.element_ty
    ks = tl.arange(0, BK)
    rstd = tl.zeros([BB], dtype=tl.float32)
    if HAS_NORM:
        sdtype = stream_ptr.dtype.element_ty
        squares = tl.zeros([BB], dtype=tl.float32)
        writes_stream = (rows * 0 + pid) == 0
        for k0 in range(0, d_model, BK):
            cols = k0 + ks
            ok = row_ok[:, None] & (cols < d_model)[None, :]
            offs = rows[:, None] * d_model + cols[None, :]
            s = tl.load(stream_ptr + offs, mask=ok, other=0.0).to(tl.float32)
            d = tl.load(delta_ptr + offs, mask=ok, other=0.0).to(sdtype).to(tl.float32)
            s = (s + d).to(sdtype)
            tl.store(new_stream_ptr + offs, s, mask=ok & writes_stream[:, None])
            normed_in = s.to(wdtype).to(tl.float32)
            squares += tl.sum(normed_in * normed_in, axis=1)
        rstd = tl.rsqrt(squares / d_model + eps)
    x = gemv_input_tile(x_ptr, stream_ptr, delta_ptr, norm_w_ptr, w_ptr, rstd, rows, row_ok, 0, d_model, HAS_NORM,
                        BK)
    acc = x[:, None, :] * w_first.to(tl.float32)[None, :, :]  # summed over K once, after the loop
    for k0 in range(BK, d_model, BK):
        x = gemv_input_tile(x_ptr, stream_ptr, delta_ptr, norm_w_ptr, w_ptr, rstd, rows, row_ok, k0, d_model,
                            HAS_NORM, BK)
        w = weight_tile(w_ptr, outs, out_ok, k0, d_model, BK)
        acc += x[:, None, :] * w.to(tl.float32)[None, :, :]
    acc = tl.sum(acc, axis=2)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + outs, mask=out_ok, other=0.0).to(tl.float32)[None, :]
    return acc.to(wdtype).to(tl.float32)


@triton.jit
def conv_inputs(
    chans, chan_ok, rows, row_ok, slot_ids_ptr, conv_pool_ptr, conv_w_ptr, conv_b_ptr, stride_conv_slot,
    stride_conv_d, HAS_CONV_BIAS: tl.constexpr, K: tl.constexpr, BKC: tl.constexpr,
):
    """What :func:`conv_update` reads for channels ``chans``: ``(tail_ptrs, window, shifted, weights, bias)``, the
    slots' tails ``[BB, BO, BKC]`` at taps 0 to K-2 (``window``) and 1 to K-2 (``shifted``), zeros elsewhere, the
    conv's weights ``[BO, BKC]`` and bias ``[BO]`` (zeros without one)."""
    taps = tl.arange(0, BKC)
    slots = tl.load(slot_ids_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    tail_ptrs = (conv_pool_ptr + slots[:, None, None] * stride_conv_slot
                 + chans[None, :, None].to(tl.int64) * stride_conv_d + taps[None, None, :])
    ok = row_ok[:, None, None] & chan_ok[None, :, None]
    window = tl.load(tail_ptrs, mask=ok & (taps < K - 1)[None, None, :], other=0.0)
    shifted = tl.load(tail_ptrs + 1, mask=ok & (taps < K - 2)[None, None, :], other=0.0)
    weights = tl.load(conv_w_ptr + chans[:, None] * K + taps[None, :], mask=chan_ok[:, None] & (taps < K)[None, :],
                      other=0.0)
    bias = tl.load(conv_b_ptr + chans, mask=chan_ok & HAS_CONV_BIAS, other=0.0)
    return tail_ptrs, window, shifted, weights, bias


@triton.jit
def conv_update(
    new, tail_ptrs, window, shifted, weights, bias, chan_ok, row_ok, HAS_CONV_BIAS: tl.constexpr, K: tl.constexpr,
    BKC: tl.constexpr,
):
    """The depthwise causal conv of ``new [BB, BO]`` (the newest input of channels ``chans``) over the slots'
    tails (:func:`conv_inputs`), in fp32 (bias added, no activation); shifts ``new`` into the tails in place."""
    taps = tl.arange(0, BKC)
    window += tl.where((taps == K - 1)[None, None, :], new[:, :, None], 0.0)
    shifted += tl.where((taps == K - 2)[None, None, :], new[:, :, None], 0.0)
    out = tl.sum(window * weights.to(tl.float32)[None, :, :], axis=2)
    if HAS_CONV_BIAS:
        out += bias.to(tl.float32)[None, :]
    tl.debug_barrier()  # every thread has read the tails before any overwrites them
    ok = row_ok[:, None, None] & chan_ok[None, :, None] & (taps < K - 1)[None, None, :]
    tl.store(tail_ptrs, shifted, mask=ok)
    return out


@triton.jit
def x_proj_columns(x_proj_w_ptr, e0, outs, is_x, d_inner, n_proj, BE: tl.constexpr):
    """x_proj's rows ``e0`` to ``e0 + BE`` at columns ``outs`` (``[BE, BO]``; zeros past the rows, or where
    ``is_x`` is false)."""
    e = e0 + tl.arange(0, BE)
    return tl.load(x_proj_w_ptr + e[:, None] * d_inner + outs[None, :], mask=(e < n_proj)[:, None] & is_x[None, :],
                   other=0.0)


@triton.jit
def store_x_proj_partial(xc, wx, e0, pid, rows, row_ok, partial_ptr, batch, n_proj, BE: tl.constexpr):
    """This program's partial sums of x_proj's rows ``e0`` to ``e0 + BE``: ``xc [BB, BO] @ wx [BE, BO].T``."""
    e = e0 + tl.arange(0, BE)
    part = tl.sum(xc[:, None, :] * wx.to(tl.float32)[None, :, :], axis=2)
    tl.store(partial_ptr + (pid * batch + rows[:, None]) * n_proj + e[None, :], part,
             mask=row_ok[:, None] & (e < n_proj)[None, :])


@triton.jit
def _mamba_in_proj_kernel(
    x_ptr, stream_ptr, delta_ptr, norm_w_ptr, new_stream_ptr, w_ptr, bias_ptr,
    conv_pool_ptr, conv_w_ptr, conv_b_ptr, slot_ids_ptr, x_proj_w_ptr, xc_ptr, z_ptr, partial_ptr, ahead_ptr,
    batch, d_model, d_inner, n_proj, eps, stride_conv_slot, stride_conv_d, n_ahead,
    HAS_NORM: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_CONV_BIAS: tl.constexpr, K: tl.constexpr,
    BB: tl.constexpr, BO: tl.constexpr, BK: tl.constexpr, BE: tl.constexpr, BKC: tl.constexpr,
    PDL: tl.constexpr, LINES: tl.constexpr, PREFETCH: tl.constexpr, EARLY: tl.constexpr, AHEAD: tl.constexpr,
):
    pid = tl.program_id(0)
    first = pid * BO
    rows = tl.arange(0, BB)
    row_ok = rows < batch
    outs = first + tl.arange(0, BO)
    out_ok = outs < 2 * d_inner
    is_x = outs < d_inner  # all or none of a program's rows
    if EARLY:
        w_first = weight_tile(w_ptr, outs, out_ok, 0, d_model, BK)
        tail_ptrs, window, shifted, conv_w, conv_b = conv_inputs(
            outs, is_x, rows, row_ok, slot_ids_ptr, conv_pool_ptr, conv_w_ptr, conv_b_ptr, stride_conv_slot,
            stride_conv_d, HAS_CONV_BIAS, K, BKC)
        wx_first = x_proj_columns(x_proj_w_ptr, 0, outs, is_x, d_inner, n_proj, BE)
    if PDL:  # while the previous kernel runs: what no kernel of this step writes (and is not loaded yet), into L2
        if (not EARLY) or (BK < d_model):
            prefetch_weight_rows(w_ptr, first, 2 * d_inner, d_model, BO, LINES)
        if PREFETCH:
            if HAS_NORM:
                prefetch_vector(norm_w_ptr, d_model)
            if first < d_inner:
                if not EARLY:
                    prefetch_conv_inputs(outs, rows, row_ok, slot_ids_ptr, conv_pool_ptr, conv_w_ptr, conv_b_ptr,
                                         stride_conv_slot, stride_conv_d, HAS_CONV_BIAS, K)
                for e0 in range(BE if EARLY else 0, n_proj, BE):
                    e = tl.minimum(e0 + tl.arange(0, BE), n_proj - 1)
                    prefetch_row_spans(x_proj_w_ptr + first, e, d_inner, BO)
        wait_for_previous_kernel()
    if not EARLY:
        w_first = weight_tile(w_ptr, outs, out_ok, 0, d_model, BK)
    wdtype = w_ptr.dtype.element_ty
    projected = normed_input_times_weight(
        x_ptr, stream_ptr, delta_ptr, norm_w_ptr, new_stream_ptr, w_ptr, bias_ptr, w_first, pid, outs, out_ok,
        rows, row_ok, d_model, eps, HAS_NORM, HAS_BIAS, BB, BO, BK,
    )
    if first < d_inner:  # x rows: conv, SiLU, this block's share of x_proj
        if not EARLY:
            tail_ptrs, window, shifted, conv_w, conv_b = conv_inputs(
                outs, is_x, rows, row_ok, slot_ids_ptr, conv_pool_ptr, conv_w_ptr, conv_b_ptr, stride_conv_slot,
                stride_conv_d, HAS_CONV_BIAS, K, BKC)
            wx_first = x_proj_columns(x_proj_w_ptr, 0, outs, is_x, d_inner, n_proj, BE)
        xc = conv_update(projected, tail_ptrs, window, shifted, conv_w, conv_b, is_x, row_ok, HAS_CONV_BIAS, K,
                         BKC)
        # The conv's output, then its SiLU, each in the activations' dtype (a conv output past the dtype's range
        # is ±inf before the SiLU, and silu(-inf) is NaN, as in the op-by-op step).
        xc = xc.to(wdtype).to(tl.float32)
        xc = (xc * tl.sigmoid(xc)).to(wdtype)
        tl.store(xc_ptr + rows[:, None] * d_inner + outs[None, :], xc, mask=row_ok[:, None])
        xc = xc.to(tl.float32)
        store_x_proj_partial(xc, wx_first, 0, pid, rows, row_ok, partial_ptr, batch, n_proj, BE)
        for e0 in range(BE, n_proj, BE):
            wx = x_proj_columns(x_proj_w_ptr, e0, outs, is_x, d_inner, n_proj, BE)
            store_x_proj_partial(xc, wx, e0, pid, rows, row_ok, partial_ptr, batch, n_proj, BE)
    else:
        tl.store(z_ptr + rows[:, None] * d_inner + (outs - d_inner)[None, :], projected.to(wdtype),
                 mask=row_ok[:, None])
    if AHEAD:  # this layer's out_proj, after this program's own work
        prefetch_share(ahead_ptr, n_ahead, pid, tl.num_programs(0), AHEAD_REQUESTS)


@triton.jit
def ssm_parameters(dt_w_ptr, dt_bias_ptr, A_ptr, D_ptr, chans, chan_ok, ranks, dt_rank, states, state_ok, d_state):
    """The SSM kernel's parameters of channels ``chans``: dt_proj's rows ``[BC, BR]`` (weights' dtype), dt's
    bias ``[BC]``, ``A [BC, BN]`` and ``D [BC]``."""
    dt_w = tl.load(dt_w_ptr + chans[:, None] * dt_rank + ranks[None, :],
                   mask=chan_ok[:, None] & (ranks < dt_rank)[None, :], other=0.0)
    dt_bias = tl.load(dt_bias_ptr + chans, mask=chan_ok, other=0.0)
    A = tl.load(A_ptr + chans[:, None] * d_state + states[None, :], mask=chan_ok[:, None] & state_ok[None, :],
                other=0.0)
    D = tl.load(D_ptr + chans, mask=chan_ok, other=0.0)
    return dt_w, dt_bias, A, D


@triton.jit
def _mamba_ssm_kernel(
    partial_ptr, dt_w_ptr, dt_bias_ptr, A_ptr, D_ptr, xc_ptr, z_ptr, ssm_pool_ptr, slot_ids_ptr, y_ptr, ahead_ptr,
    batch, d_inner, n_blocks, dt_rank, d_state, stride_ssm_slot, stride_ssm_d, n_ahead,
    BP: tl.constexpr, BR: tl.constexpr, BN: tl.constexpr, BC: tl.constexpr, PDL: tl.constexpr,
    PREFETCH: tl.constexpr, EARLY: tl.constexpr, AHEAD: tl.constexpr,
):
    b = tl.program_id(0)
    chans = tl.program_id(1) * BC + tl.arange(0, BC)
    chan_ok = chans < d_inner
    wdtype = dt_w_ptr.dtype.element_ty
    n_proj = dt_rank + 2 * d_state
    ranks = tl.arange(0, BR)
    states = tl.arange(0, BN)
    state_ok = states < d_state
    # The slot's state rows first (no earlier kernel of this step writes them), and with EARLY the parameters,
    # then what in_proj wrote (x and z in flight with the partial sums). Without EARLY the parameters are read
    # after the partial sums; under dependent launch L2 has been asked for them before the wait.
    slot = tl.load(slot_ids_ptr + b).to(tl.int64)
    ok = chan_ok[:, None] & state_ok[None, :]
    state_ptrs = ssm_pool_ptr + slot * stride_ssm_slot + chans[:, None] * stride_ssm_d + states[None, :]
    h = tl.load(state_ptrs, mask=ok, other=0.0)
    if EARLY:
        dt_w, dt_bias, A, D = ssm_parameters(dt_w_ptr, dt_bias_ptr, A_ptr, D_ptr, chans, chan_ok, ranks, dt_rank,
                                             states, state_ok, d_state)
    if PDL:
        if PREFETCH and not EARLY:
            valid = tl.minimum(chans, d_inner - 1)
            prefetch_row_spans(dt_w_ptr, valid, dt_rank, dt_rank)
            prefetch_row_spans(A_ptr, valid, d_state, d_state)
            prefetch_l2(dt_bias_ptr + valid)
            prefetch_l2(D_ptr + valid)
        wait_for_previous_kernel()
    x = tl.load(xc_ptr + b * d_inner + chans, mask=chan_ok, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + b * d_inner + chans, mask=chan_ok, other=0.0).to(tl.float32)
    dt_low = tl.zeros([BR], dtype=tl.float32)
    B = tl.zeros([BN], dtype=tl.float32)
    C = tl.zeros([BN], dtype=tl.float32)
    for p0 in range(0, n_blocks, BP):
        blocks = p0 + tl.arange(0, BP)
        base = partial_ptr + (blocks[:, None] * batch + b) * n_proj
        block_ok = (blocks < n_blocks)[:, None]
        dt_low += tl.sum(tl.load(base + ranks[None, :], mask=block_ok & (ranks < dt_rank)[None, :], other=0.0), 0)
        B += tl.sum(tl.load(base + dt_rank + states[None, :], mask=block_ok & state_ok[None, :], other=0.0), 0)
        C += tl.sum(tl.load(base + dt_rank + d_state + states[None, :], mask=block_ok & state_ok[None, :],
                            other=0.0), 0)
    # x_proj's and dt_proj's outputs in the weights' dtype, as the op-by-op step rounds them.
    dt_low = dt_low.to(wdtype).to(tl.float32)
    B = B.to(wdtype).to(tl.float32)
    C = C.to(wdtype).to(tl.float32)
    if not EARLY:
        dt_w, dt_bias, A, D = ssm_parameters(dt_w_ptr, dt_bias_ptr, A_ptr, D_ptr, chans, chan_ok, ranks, dt_rank,
                                             states, state_ok, d_state)
    dt = tl.sum(dt_w.to(tl.float32) * dt_low[None, :], axis=1).to(wdtype).to(tl.float32)
    dt = softplus_f32(dt + dt_bias)
    h = tl.exp(dt[:, None] * A) * h + (dt * x)[:, None] * B[None, :]
    tl.store(state_ptrs, h, mask=ok)
    y = tl.sum(h * C[None, :], axis=1) + x * D
    # y silu(z), the reference's order: (y z) sigmoid(z) overflows where y silu(z) does not (y, -z near 1e30).
    tl.store(y_ptr + b * d_inner + chans, (y * (z * tl.sigmoid(z))).to(wdtype), mask=chan_ok)
    if AHEAD:  # the next layer's in_proj, after this program's own work
        prefetch_share(ahead_ptr, n_ahead, b * tl.num_programs(1) + tl.program_id(1),
                       tl.num_programs(0) * tl.num_programs(1), AHEAD_REQUESTS)


@triton.jit
def _mamba_out_proj_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, batch, n_in, n_out,
    HAS_BIAS: tl.constexpr, BB: tl.constexpr, BO: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr,
    LINES: tl.constexpr, EARLY: tl.constexpr,
):
    pid = tl.program_id(0)
    outs = pid * BO + tl.arange(0, BO)
    out_ok = outs < n_out
    if EARLY:
        w_first = weight_tile(w_ptr, outs, out_ok, 0, n_in, BK)
    if PDL:
        if (not EARLY) or (BK < n_in):
            prefetch_weight_rows(w_ptr, pid * BO, n_out, n_in, BO, LINES)
        wait_for_previous_kernel()
    if not EARLY:
        w_first = weight_tile(w_ptr, outs, out_ok, 0, n_in, BK)
    rows = tl.arange(0, BB)
    row_ok = rows < batch
    projected = normed_input_times_weight(
        x_ptr, x_ptr, x_ptr, x_ptr, x_ptr, w_ptr, bias_ptr, w_first, pid, outs, out_ok, rows, row_ok, n_in, 0.0,
        False, HAS_BIAS, BB, BO, BK,
    )
    tl.store(out_ptr + rows[:, None] * n_out + outs[None, :], projected.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & out_ok[None, :])


def stack_applies(normed: torch.Tensor, conv_pool: torch.Tensor, ssm_pool: torch.Tensor) -> bool:
    """Whether a Triton decode stack (this one or Mamba-2's) takes ``normed [B, d_model]`` of 1 to
    :data:`MAX_ROWS` rows and these fp32 pools (unit stride on their last dimension; a conv of width 2 or more),
    with gradients off."""
    return (
        normed.dim() == 2
        and 1 <= normed.shape[0] <= MAX_ROWS
        and conv_pool.shape[-1] >= 1
        and conv_pool.dtype == torch.float32
        and conv_pool.stride(-1) == 1
        and ssm_pool.dtype == torch.float32
        and ssm_pool.stride(-1) == 1
        and not torch.is_grad_enabled()
    )


def pow2(n: int) -> int:
    """The smallest power of two >= n (and >= 1): a block size covering n."""
    return triton.next_power_of_2(max(int(n), 1))


def l2_lines(rows: int, row_bytes: int) -> int:
    """``LINES`` of :func:`prefetch_weight_rows` for ``rows`` rows of ``row_bytes`` (a power of two): one more
    than the rows fill, for rows that do not start on a line (the lanes past the end ask for the last one)."""
    return pow2(triton.cdiv(rows * row_bytes, L2_LINE.value) + 1)


def dependent_launch(wanted: bool, device: torch.device) -> bool:
    """Launch a stack's kernels with programmatic dependent launch: ``wanted`` (its ``LAUNCH_PDL``) and on a CUDA
    device of compute capability 9.0 or newer (older GPUs and the interpreter have none)."""
    return wanted and device.type == "cuda" and _compute_capability(device.index)[0] >= 9


@functools.cache
def _compute_capability(index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def weight_lines(weight: torch.Tensor, rows: int) -> int:
    """:func:`l2_lines` for ``rows`` rows of ``weight``."""
    return l2_lines(rows, weight.shape[-1] * weight.element_size())


def in_proj_blocks(batch_block: int, d_model: int, d_inner: int, n_proj: int) -> tuple[int, int, int]:
    """``(BO, BK, BE)`` of :func:`_mamba_in_proj_kernel`: :data:`IN_PROJ_ROWS` in_proj rows a program (a power of
    two that divides ``d_inner``, so no program straddles x and z), the K step filling :data:`TILE` and the x_proj
    step half of it (a full one spills at 8 rows on sm_90)."""
    block_o = min(IN_PROJ_ROWS, d_inner & -d_inner)
    budget = max(16, TILE // (batch_block * block_o))
    return block_o, min(pow2(d_model), budget), min(pow2(n_proj), max(16, budget // 2))


def gemv_blocks(batch_block: int, n_in: int, rows: int, tile: int) -> tuple[int, int]:
    """``(BO, BK)`` of a stack's GEMV kernel (the out_projs, Mamba-2's in_proj): ``rows`` output rows a program
    (many programs for a short output; a stack's ``OUT_PROJ_ROWS`` or ``IN_PROJ_ROWS``), the K step filling
    ``tile`` elements (its ``OUT_PROJ_TILE`` or ``TILE``)."""
    return rows, min(pow2(n_in), max(16, tile // (batch_block * rows)))


def mamba_out_proj_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x [B, K] @ weight[N, K].T + bias`` for at most :data:`MAX_ROWS` contiguous rows, in ``x``'s dtype."""
    batch, n_in = x.shape
    n_out = weight.shape[0]
    out = torch.empty(batch, n_out, dtype=x.dtype, device=x.device)
    batch_block = pow2(batch)
    block_o, block_k = gemv_blocks(batch_block, n_in, OUT_PROJ_ROWS, OUT_PROJ_TILE)
    pdl = dependent_launch(LAUNCH_PDL, x.device)
    _mamba_out_proj_kernel[(triton.cdiv(n_out, block_o),)](
        x, weight, bias if bias is not None else weight, out, batch, n_in, n_out,
        HAS_BIAS=bias is not None, BB=batch_block, BO=block_o, BK=block_k, PDL=pdl,
        LINES=weight_lines(weight, block_o), EARLY=EARLY_LOADS, num_warps=NUM_WARPS, launch_pdl=pdl,
    )
    return out


def mamba_decode_stack_triton(
    normed: torch.Tensor,
    stream: torch.Tensor,
    norm_weights: Sequence[torch.Tensor],
    eps: float,
    layers: Sequence[Sequence[torch.Tensor | None]],
    conv_pool: torch.Tensor,
    ssm_pool: torch.Tensor,
    slot_ids: torch.Tensor,
) -> torch.Tensor:
    """Every layer of a decode step of at most :data:`MAX_ROWS` sequences; returns the final norm's output.

    Same contract as :func:`~rnnserve.kernels.mamba_decode.mamba_decode_stack` with float projections (the
    int8 scales must be None): ``normed``/``stream`` the first block's input and the residual stream,
    ``norm_weights[i]`` block ``i + 1``'s norm and last the final one, ``conv_pool [N, L, Di, K-1]`` and
    ``ssm_pool [N, L, Di, Ns]`` fp32 with unit stride on their last dimension (``ssm_pool`` also on ``Di``'s
    rows), advanced in place at rows ``slot_ids``.
    """
    batch, d_model = normed.shape
    if not 1 <= batch <= MAX_ROWS:
        raise ValueError(f"the Triton decode stack takes 1 to {MAX_ROWS} rows, got {batch}")
    if any(scale is not None for layer in layers for scale in layer[11:]):
        raise ValueError("the Triton decode stack takes float projections only")
    first = layers[0]
    dtype, device = first[0].dtype, normed.device
    d_inner, width = first[2].shape
    d_state, dt_rank = first[7].shape[1], first[5].shape[1]
    n_proj = dt_rank + 2 * d_state
    batch_block = pow2(batch)
    block_o, block_k, block_e = in_proj_blocks(batch_block, d_model, d_inner, n_proj)
    pdl = dependent_launch(LAUNCH_PDL, normed.device)
    x_blocks = d_inner // block_o
    block_c = min(SSM_CHANNELS, pow2(d_inner))
    block_r, block_n = pow2(dt_rank), pow2(d_state)
    block_p = min(pow2(x_blocks), max(1, 4096 // max(block_r, block_n)))
    slot_ids = slot_ids.long().contiguous()
    xc = torch.empty(batch, d_inner, dtype=dtype, device=device)
    z = torch.empty_like(xc)
    y = torch.empty_like(xc)
    partial = torch.empty(x_blocks, batch, n_proj, dtype=torch.float32, device=device)
    streams = (torch.empty_like(stream), torch.empty_like(stream))
    normed = normed.contiguous()
    stream = stream.contiguous()
    delta = None
    ahead = pdl and PREFETCH_AHEAD  # the requests are inline PTX, run where dependent launch is
    for i, layer in enumerate(layers):
        in_w, in_b, conv_w, conv_b, x_w, dt_w, dt_b, A, D, out_w, out_b = (
            None if t is None else t.contiguous() for t in layer[:11]
        )
        has_next = i + 1 < len(layers)
        next_in_w = layers[i + 1][0].contiguous() if has_next else in_w  # in_w: a placeholder, not asked for
        conv, ssm = conv_pool[:, i], ssm_pool[:, i]
        new_stream = streams[i % 2]
        _mamba_in_proj_kernel[(2 * d_inner // block_o,)](
            normed, stream, delta if delta is not None else normed, norm_weights[i - 1], new_stream, in_w,
            in_b if in_b is not None else in_w, conv, conv_w, conv_b if conv_b is not None else conv_w, slot_ids,
            x_w, xc, z, partial, out_w, batch, d_model, d_inner, n_proj, eps, conv.stride(0), conv.stride(1),
            out_w.numel(), HAS_NORM=delta is not None, HAS_BIAS=in_b is not None, HAS_CONV_BIAS=conv_b is not None,
            K=width, BB=batch_block, BO=block_o, BK=block_k, BE=block_e, BKC=pow2(width), PDL=pdl,
            LINES=weight_lines(in_w, block_o), PREFETCH=PREFETCH_INPUTS, EARLY=EARLY_LOADS,
            AHEAD=ahead, num_warps=NUM_WARPS, launch_pdl=pdl,
        )
        if delta is not None:
            stream = new_stream
        _mamba_ssm_kernel[(batch, triton.cdiv(d_inner, block_c))](
            partial, dt_w, dt_b, A, D, xc, z, ssm, slot_ids, y, next_in_w, batch, d_inner, x_blocks, dt_rank, d_state,
            ssm.stride(0), ssm.stride(1), next_in_w.numel(), BP=block_p, BR=block_r, BN=block_n, BC=block_c,
            PDL=pdl, PREFETCH=PREFETCH_INPUTS, EARLY=EARLY_LOADS, AHEAD=ahead and has_next, num_warps=SSM_WARPS,
            launch_pdl=pdl,
        )
        delta = mamba_out_proj_triton(y, out_w, out_b)
    normed, _ = residual_rms_norm_triton(stream, delta, norm_weights[-1], eps, False)
    return normed


__all__ = ["MAX_ROWS", "mamba_decode_stack_triton"]
