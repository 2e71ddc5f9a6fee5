"""A persistent Triton decode step of a whole Mamba-2 stack: one launch a step instead of three kernels a layer.

A grid of at most one program per SM (:func:`~rnnserve.kernels.mamba_decode.persistent.persistent_grid`) runs
every layer's three phases, the work items of :mod:`~rnnserve.kernels.mamba2_decode.fused_recurrent`'s kernels
(:func:`in_proj_item`, :func:`ssm_item`, :func:`out_proj_item`: the same code, so the same results bit for bit),
each program striding over a phase's items, and the programs meet at
:func:`~rnnserve.kernels.mamba_decode.fused_recurrent.grid_barrier` after each phase; the final residual RMSNorm
is the last phase. A layer's weights come from an int64 table of addresses
(:func:`~rnnserve.kernels.mamba_decode.persistent.pointer_table`), each hinted as 16-byte aligned (the table
takes only such tensors), so the GEMVs' weight loads stay 16-byte vector loads. What one program writes and
another reads after a barrier (``z``, ``xBC``, ``dt``, the gated ``y`` and its sums of squares, out_proj's
output and the stream in the last phase) is loaded with ``.cg``, past the SM's L1, which is not coherent between
SMs, and so are the stream and out_proj's output that in_proj reads (through
:func:`~rnnserve.kernels.mamba_decode.fused_recurrent.normed_input_times_weight`).

``PHASE`` (a constexpr) >= 0 runs one phase of one layer, without barriers: the tests launch each phase with
several programs that way, since the interpreter runs programs one after another and a barrier passes there only
for a single program.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from rnnserve.kernels.mamba2_decode import fused_recurrent as stack
from rnnserve.kernels.mamba2_decode.fused_recurrent import in_proj_item, out_proj_item, ssm_item
from rnnserve.kernels.mamba_decode import fused_recurrent as mamba1
from rnnserve.kernels.mamba_decode.fused_recurrent import grid_barrier
from rnnserve.kernels.mamba_decode.persistent import (
    POINTER_ALIGNMENT,
    layer_pointer,
    persistent_grid,
    pointer_table,
    stream_before,
)
from rnnserve.kernels.residual_rms_norm.fused import residual_rms_norm_row

# Rows of the pointer table: a layer's tensors in the order of the stack's ``layers`` tuples, then the norm
# before the layer (the previous block's; unused at layer 0).
IN_W, IN_B, CONV_W, CONV_B, DT_BIAS, A_LOG, D, GATED_W, OUT_W, OUT_B, NORM_W = (tl.constexpr(f) for f in range(11))
FINAL_PHASE = 3  # PHASE of the final residual RMSNorm


@triton.jit
def _in_proj_phase(
    layer, pid, programs, x_ptr, stream_ptr, streams_ptr, delta_ptr, table_ptr, conv_pool_ptr, slot_ids_ptr,
    z_ptr, xbc_ptr, dt_ptr, n_layers, batch, d_model, d_inner, conv_dim, heads, eps, stride_conv_slot,
    stride_conv_layer, stride_conv_d,
    HAS_BIAS: tl.constexpr, HAS_CONV_BIAS: tl.constexpr, K: tl.constexpr, BB: tl.constexpr, BO: tl.constexpr,
    BK: tl.constexpr, BKC: tl.constexpr, EARLY: tl.constexpr,
):
    """Layer ``layer``'s in_proj items: layer 0 reads the normed input, the others add the previous out_proj's
    output to the stream (the caller's at layer 1, then ``streams_ptr``'s two rows in turn) and norm it."""
    wdtype = x_ptr.dtype.element_ty
    w = layer_pointer(table_ptr, IN_W, layer, n_layers, wdtype)
    bias = layer_pointer(table_ptr, IN_B, layer, n_layers, wdtype) if HAS_BIAS else w
    conv_w = layer_pointer(table_ptr, CONV_W, layer, n_layers, wdtype)
    conv_b = layer_pointer(table_ptr, CONV_B, layer, n_layers, wdtype) if HAS_CONV_BIAS else conv_w
    norm_w = layer_pointer(table_ptr, NORM_W, layer, n_layers, wdtype)
    conv = conv_pool_ptr + layer * stride_conv_layer
    n_items = tl.cdiv(d_inner + conv_dim + heads, BO)
    rows_size = batch * d_model
    new_stream = streams_ptr + (layer % 2) * rows_size
    if layer == 0:
        for item in range(pid, n_items, programs):
            in_proj_item(item, programs, x_ptr, stream_ptr, x_ptr, norm_w, new_stream, w, bias, conv, conv_w, conv_b,
                         slot_ids_ptr, z_ptr, xbc_ptr, dt_ptr, w, batch, d_model, d_inner, conv_dim, heads, eps,
                         stride_conv_slot, stride_conv_d, 0, False, HAS_BIAS, HAS_CONV_BIAS, K, BB, BO, BK, BKC,
                         False, 1, False, EARLY, False, ".cg")
    else:
        old_stream = stream_before(stream_ptr, streams_ptr, layer, rows_size)
        for item in range(pid, n_items, programs):
            in_proj_item(item, programs, x_ptr, old_stream, delta_ptr, norm_w, new_stream, w, bias, conv, conv_w,
                         conv_b, slot_ids_ptr, z_ptr, xbc_ptr, dt_ptr, w, batch, d_model, d_inner, conv_dim, heads,
                         eps, stride_conv_slot, stride_conv_d, 0, True, HAS_BIAS, HAS_CONV_BIAS, K, BB, BO, BK, BKC,
                         False, 1, False, EARLY, False, ".cg")


@triton.jit
def _ssm_phase(
    layer, pid, programs, x_ptr, table_ptr, ssm_pool_ptr, slot_ids_ptr, z_ptr, xbc_ptr, dt_ptr, gated_ptr,
    squares_ptr, n_layers, batch, d_inner, conv_dim, heads, head_dim, d_state, heads_per_group, groups, p_blocks,
    dt_min, dt_max, stride_ssm_slot, stride_ssm_layer, stride_ssm_h, stride_ssm_p,
    BP: tl.constexpr, BN: tl.constexpr,
):
    """Layer ``layer``'s SSM items, ``(sequence, head, channel block)`` in that order."""
    wdtype = x_ptr.dtype.element_ty
    dt_bias = layer_pointer(table_ptr, DT_BIAS, layer, n_layers, wdtype)
    A_log = layer_pointer(table_ptr, A_LOG, layer, n_layers, wdtype)
    D_param = layer_pointer(table_ptr, D, layer, n_layers, wdtype)
    ssm = ssm_pool_ptr + layer * stride_ssm_layer
    parts = heads * p_blocks
    for item in range(pid, batch * parts, programs):
        ssm_item(item // parts, (item % parts) // p_blocks, item % p_blocks, batch, p_blocks, xbc_ptr, dt_ptr, z_ptr,
                 dt_bias, A_log, D_param, ssm, slot_ids_ptr, gated_ptr, squares_ptr, x_ptr, d_inner, conv_dim, heads,
                 head_dim, d_state, heads_per_group, groups, dt_min, dt_max, stride_ssm_slot, stride_ssm_h,
                 stride_ssm_p, 0, BP, BN, False, False, ".cg")


@triton.jit
def _out_proj_phase(
    layer, pid, programs, x_ptr, table_ptr, gated_ptr, squares_ptr, delta_ptr, n_layers, batch, d_inner, d_model,
    parts, parts_per_group, group_width, gated_eps,
    HAS_BIAS: tl.constexpr, BB: tl.constexpr, BO: tl.constexpr, BK: tl.constexpr, BQ: tl.constexpr,
    BG: tl.constexpr, EARLY: tl.constexpr,
):
    """Layer ``layer``'s out_proj items, the gated group norm applied as they read their input."""
    wdtype = x_ptr.dtype.element_ty
    w = layer_pointer(table_ptr, OUT_W, layer, n_layers, wdtype)
    bias = layer_pointer(table_ptr, OUT_B, layer, n_layers, wdtype) if HAS_BIAS else w
    gated_w = layer_pointer(table_ptr, GATED_W, layer, n_layers, wdtype)
    for item in range(pid, tl.cdiv(d_model, BO), programs):
        out_proj_item(item, gated_ptr, squares_ptr, gated_w, w, bias, delta_ptr, batch, d_inner, d_model, parts,
                      parts_per_group, group_width, gated_eps, HAS_BIAS, BB, BO, BK, BQ, BG, False, 1, False, EARLY,
                      ".cg")


@triton.jit
def _final_phase(pid, programs, stream_ptr, streams_ptr, delta_ptr, final_w_ptr, out_ptr, n_layers, batch, d_model,
                 eps, BN: tl.constexpr):
    """The final residual RMSNorm of each row (the new stream into the row of ``streams_ptr`` no layer left)."""
    rows_size = batch * d_model
    last_stream = stream_before(stream_ptr, streams_ptr, n_layers, rows_size)
    spare = streams_ptr + (n_layers % 2) * rows_size
    for row in range(pid, batch, programs):
        residual_rms_norm_row(last_stream, delta_ptr, final_w_ptr, out_ptr, spare, row + tl.zeros([], tl.int64),
                              d_model, eps, d_model, d_model, True, False, BN, ".cg")


@triton.jit
def _mamba2_persistent_kernel(
    x_ptr, stream_ptr, streams_ptr, delta_ptr, final_w_ptr, out_ptr, table_ptr, conv_pool_ptr, ssm_pool_ptr,
    slot_ids_ptr, z_ptr, xbc_ptr, dt_ptr, gated_ptr, squares_ptr, counter_ptr, layer,
    n_layers, batch, d_model, d_inner, conv_dim, heads, head_dim, d_state, heads_per_group, groups, p_blocks,
    parts_per_group, group_width, eps, gated_eps, dt_min, dt_max, stride_conv_slot, stride_conv_layer,
    stride_conv_d, stride_ssm_slot, stride_ssm_layer, stride_ssm_h, stride_ssm_p,
    HAS_BIAS: tl.constexpr, HAS_CONV_BIAS: tl.constexpr, HAS_OUT_BIAS: tl.constexpr, K: tl.constexpr,
    BB: tl.constexpr, BO: tl.constexpr, BK: tl.constexpr, BKC: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
    OUT_BO: tl.constexpr, OUT_BK: tl.constexpr, BQ: tl.constexpr, BG: tl.constexpr, BM: tl.constexpr,
    EARLY: tl.constexpr, PHASE: tl.constexpr,
):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    parts = heads * p_blocks
    if PHASE < 0:
        for i in range(n_layers):
            _in_proj_phase(i, pid, programs, x_ptr, stream_ptr, streams_ptr, delta_ptr, table_ptr, conv_pool_ptr,
                           slot_ids_ptr, z_ptr, xbc_ptr, dt_ptr, n_layers, batch, d_model, d_inner, conv_dim, heads,
                           eps, stride_conv_slot, stride_conv_layer, stride_conv_d, HAS_BIAS, HAS_CONV_BIAS, K, BB,
                           BO, BK, BKC, EARLY)
            grid_barrier(counter_ptr, (3 * i + 1) * programs)
            _ssm_phase(i, pid, programs, x_ptr, table_ptr, ssm_pool_ptr, slot_ids_ptr, z_ptr, xbc_ptr, dt_ptr,
                       gated_ptr, squares_ptr, n_layers, batch, d_inner, conv_dim, heads, head_dim, d_state,
                       heads_per_group, groups, p_blocks, dt_min, dt_max, stride_ssm_slot, stride_ssm_layer,
                       stride_ssm_h, stride_ssm_p, BP, BN)
            grid_barrier(counter_ptr, (3 * i + 2) * programs)
            _out_proj_phase(i, pid, programs, x_ptr, table_ptr, gated_ptr, squares_ptr, delta_ptr, n_layers, batch,
                            d_inner, d_model, parts, parts_per_group, group_width, gated_eps, HAS_OUT_BIAS, BB,
                            OUT_BO, OUT_BK, BQ, BG, EARLY)
            grid_barrier(counter_ptr, (3 * i + 3) * programs)
        _final_phase(pid, programs, stream_ptr, streams_ptr, delta_ptr, final_w_ptr, out_ptr, n_layers, batch,
                     d_model, eps, BM)
    elif PHASE == 0:
        _in_proj_phase(layer, pid, programs, x_ptr, stream_ptr, streams_ptr, delta_ptr, table_ptr, conv_pool_ptr,
                       slot_ids_ptr, z_ptr, xbc_ptr, dt_ptr, n_layers, batch, d_model, d_inner, conv_dim, heads, eps,
                       stride_conv_slot, stride_conv_layer, stride_conv_d, HAS_BIAS, HAS_CONV_BIAS, K, BB, BO, BK,
                       BKC, EARLY)
    elif PHASE == 1:
        _ssm_phase(layer, pid, programs, x_ptr, table_ptr, ssm_pool_ptr, slot_ids_ptr, z_ptr, xbc_ptr, dt_ptr,
                   gated_ptr, squares_ptr, n_layers, batch, d_inner, conv_dim, heads, head_dim, d_state,
                   heads_per_group, groups, p_blocks, dt_min, dt_max, stride_ssm_slot, stride_ssm_layer, stride_ssm_h,
                   stride_ssm_p, BP, BN)
    elif PHASE == 2:
        _out_proj_phase(layer, pid, programs, x_ptr, table_ptr, gated_ptr, squares_ptr, delta_ptr, n_layers, batch,
                        d_inner, d_model, parts, parts_per_group, group_width, gated_eps, HAS_OUT_BIAS, BB, OUT_BO,
                        OUT_BK, BQ, BG, EARLY)
    else:
        _final_phase(pid, programs, stream_ptr, streams_ptr, delta_ptr, final_w_ptr, out_ptr, n_layers, batch,
                     d_model, eps, BM)


def persistent_applies(normed: torch.Tensor, layers: Sequence[Sequence[torch.Tensor | None]],
                       norm_weights: Sequence[torch.Tensor]) -> bool:
    """Whether :func:`mamba2_decode_stack_persistent` takes these tensors in one launch: every parameter of the
    normed input's dtype, contiguous and 16-byte aligned, and each bias present in every layer or in none (the
    others run :func:`~rnnserve.kernels.mamba2_decode.fused_recurrent.mamba2_decode_stack_triton`)."""
    dtype = normed.dtype
    for field in range(len(layers[0])):
        present = [layer[field] is not None for layer in layers]
        if any(present) and not all(present):
            return False
    tensors = [t for layer in layers for t in layer if t is not None] + list(norm_weights)
    return all(t.dtype == dtype and t.is_contiguous() and t.data_ptr() % POINTER_ALIGNMENT == 0 for t in tensors)


def mamba2_decode_stack_persistent(
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
    programs: int | None = None,
) -> torch.Tensor:
    """:func:`~rnnserve.kernels.mamba2_decode.fused_recurrent.mamba2_decode_stack_triton` (same arguments and
    result) in one persistent launch where :func:`persistent_applies`, else that function. ``programs``: the
    grid (default: :func:`~rnnserve.kernels.mamba_decode.persistent.persistent_grid`; more than one only where
    all are resident at once)."""
    batch, d_model = normed.shape
    if not 1 <= batch <= mamba1.MAX_ROWS:
        raise ValueError(f"the Triton decode stack takes 1 to {mamba1.MAX_ROWS} rows, got {batch}")
    args = (normed, stream, norm_weights, eps, layers, conv_pool, ssm_pool, slot_ids, groups, gated_eps, dt_limits)
    if not persistent_applies(normed, layers, norm_weights):
        return stack.mamba2_decode_stack_triton(*args)
    launch = persistent_launch(*args)
    launch.run(programs or launch.grid)
    return launch.out


class PersistentLaunch:
    """One step's :func:`_mamba2_persistent_kernel` launch: its buffers (allocated, the counter zeroed), sizes
    and constexprs, the grid it may have, and the output it fills."""

    def __init__(self, buffers: tuple, sizes: tuple, constexprs: dict, grid: int, out: torch.Tensor) -> None:
        self.buffers, self.sizes, self.constexprs, self.grid, self.out = buffers, sizes, constexprs, grid, out

    def run(self, programs: int, phase: int = -1, layer: int = 0) -> None:
        """Launch ``programs`` programs: the whole step (``phase`` -1), or one ``phase`` of ``layer`` (0 in_proj,
        1 the SSM, 2 out_proj, :data:`FINAL_PHASE` the final norm) without barriers."""
        _mamba2_persistent_kernel[(programs,)](*self.buffers, layer, *self.sizes, **self.constexprs, PHASE=phase,
                                               num_warps=stack.NUM_WARPS)


def persistent_launch(
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
) -> PersistentLaunch:
    """Everything :func:`mamba2_decode_stack_persistent` launches with (arguments: its), but ``layer`` and
    ``PHASE``, which the caller adds."""
    batch, d_model = normed.shape
    heads, head_dim, d_state = ssm_pool.shape[2:]
    d_inner = heads * head_dim
    dtype, device = normed.dtype, normed.device
    first = layers[0]
    conv_dim, width = first[2].shape[0], first[2].shape[-1]
    n_out = d_inner + conv_dim + heads
    batch_block = mamba1.pow2(batch)
    block_o, block_k = mamba1.gemv_blocks(batch_block, d_model, stack.IN_PROJ_ROWS, stack.TILE)
    block_p = min(stack.SSM_CHANNELS, mamba1.pow2(head_dim))
    p_blocks = triton.cdiv(head_dim, block_p)
    parts = heads * p_blocks
    out_block_o, out_block_k = mamba1.gemv_blocks(batch_block, d_inner, stack.OUT_PROJ_ROWS, stack.OUT_PROJ_TILE)
    # Each layer's tensors, and the norm before it (layer 0's a placeholder: it has none).
    fields = [[layer[f] if layer[f] is not None else layer[0] for layer in layers] for f in range(len(first))]
    table = pointer_table([*fields, [norm_weights[0], *norm_weights[:-1]]])
    out = torch.empty(batch, d_model, dtype=dtype, device=device)
    counter = torch.empty(1, dtype=torch.int32, device=device)
    counter.zero_()
    buffers = (
        normed.contiguous(), stream.contiguous(),
        torch.empty(2, batch, d_model, dtype=stream.dtype, device=device),  # the stream, layer by layer
        torch.empty(batch, d_model, dtype=dtype, device=device),  # out_proj's output
        norm_weights[-1].contiguous(), out, table, conv_pool, ssm_pool, slot_ids.long().contiguous(),
        torch.empty(batch, d_inner, dtype=dtype, device=device),  # z
        torch.empty(batch, conv_dim, dtype=dtype, device=device),  # xBC after the conv and SiLU
        torch.empty(batch, heads, dtype=dtype, device=device),  # dt
        torch.empty(batch, d_inner, dtype=torch.float32, device=device),  # the gated y
        torch.empty(batch, parts, dtype=torch.float32, device=device),  # its sums of squares
        counter,
    )
    sizes = (len(layers), batch, d_model, d_inner, conv_dim, heads, head_dim, d_state, heads // groups, groups,
             p_blocks, parts // groups, d_inner // groups, eps, gated_eps, dt_limits[0], dt_limits[1],
             conv_pool.stride(0), conv_pool.stride(1), conv_pool.stride(2), ssm_pool.stride(0), ssm_pool.stride(1),
             ssm_pool.stride(2), ssm_pool.stride(3))
    constexprs = {
        "HAS_BIAS": first[1] is not None, "HAS_CONV_BIAS": first[3] is not None, "HAS_OUT_BIAS": first[9] is not None,
        "K": width, "BB": batch_block, "BO": block_o, "BK": block_k, "BKC": mamba1.pow2(width), "BP": block_p,
        "BN": mamba1.pow2(d_state), "OUT_BO": out_block_o, "OUT_BK": out_block_k, "BQ": mamba1.pow2(parts),
        "BG": mamba1.pow2(groups), "BM": mamba1.pow2(d_model), "EARLY": stack.EARLY_LOADS,
    }
    grid = persistent_grid(device, max(triton.cdiv(n_out, block_o), batch * parts, triton.cdiv(d_model, out_block_o)))
    return PersistentLaunch(buffers, sizes, constexprs, grid, out)


__all__ = ["mamba2_decode_stack_persistent", "persistent_applies"]
