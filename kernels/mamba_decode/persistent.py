"""A persistent Triton decode step of a whole Mamba-1 stack: one launch a step instead of three kernels a layer.

:func:`mamba_decode_stack_persistent` launches ``_mamba_persistent_kernel`` once: a grid of at most one program per
SM walks the layers, each in three phases, the work items of
:mod:`~rnnserve.kernels.mamba_decode.fused_recurrent`'s three kernels (the same ``@triton.jit`` functions):

1. in_proj items (:func:`~rnnserve.kernels.mamba_decode.fused_recurrent.mamba_in_proj_item`), the residual add
   and the norm recomputed in each, the conv update and x_proj's partial sums;
2. SSM items (:func:`~rnnserve.kernels.mamba_decode.fused_recurrent.mamba_ssm_item`), one (sequence, channel
   block) each;
3. out_proj items (:func:`~rnnserve.kernels.mamba_decode.fused_recurrent.mamba_out_proj_item`);

and, after the last layer, the final residual RMSNorm (a row an item). A program takes items ``pid``,
``pid + programs``, ... of a phase, and all meet at
:func:`~rnnserve.kernels.mamba_decode.fused_recurrent.grid_barrier` after each phase. What one program writes and
another reads within the launch (the stream, out_proj's output, x after the conv, z, y, the partial sums) is
loaded with ``cache_modifier=".cg"`` (past L1, which is not coherent between SMs); the state rows and conv tails
an item advances are its own. Each layer's tensors are addresses in an int64 table (:func:`pointer_table`); the
pools' layers are strides. The results equal the three-kernel stack's bit for bit where the reductions are the
same (under the interpreter; on a GPU this kernel's 8 warps may sum the SSM's and the final norm's terms in
another order than the 4-warp launches).

Deadlock: a barrier waits for every program, so all must be resident at once: the grid is at most the device's SM
count (:func:`persistent_grid`), one program must fit an SM alone (at most 255 registers a thread at 8 warps,
checked by tests/kernels/test_compile_for_gpu.py), and nothing else may hold the SMs for good meanwhile.

Helpers any persistent decode stack shares (the Mamba-2 stack's too): :func:`pointer_table`, the per-layer
addresses a kernel loads from memory (cached, so that a CUDA graph capture finds the table built), and
:func:`persistent_grid`, the grid a launch whose programs meet at ``grid_barrier`` may have.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from rnnserve.kernels.mamba_decode import fused_recurrent
from rnnserve.kernels.mamba_decode.fused_recurrent import (
    grid_barrier,
    mamba_in_proj_item,
    mamba_out_proj_item,
    mamba_ssm_item,
    pow2,
    stack_shape,
)
from rnnserve.kernels.residual_rms_norm.fused import residual_rms_norm_row

POINTER_ALIGNMENT = 16  # bytes: the kernels tell the compiler each table address is a multiple (16-byte loads)
TABLE_CACHE_SIZE = 16  # tables kept (a table per model and device; tests build many)
_tables: OrderedDict[tuple, torch.Tensor] = OrderedDict()


def pointer_table(columns: Sequence[Sequence[torch.Tensor]]) -> torch.Tensor:
    """The addresses of ``columns[f][i]`` (field ``f`` of layer ``i``) as an int64 ``[fields, layers]`` tensor on
    the tensors' device, for a kernel to load a layer's pointers from (``tl.load(...).to(tl.pointer_type(...))``).

    Built once per set of tensors (keyed on their addresses, shapes and dtypes; the last
    :data:`TABLE_CACHE_SIZE` kept): building one is a host-to-device copy, which a CUDA graph capture cannot do,
    so a step captured after an eager one with the same weights finds its table here. Every tensor must be
    contiguous and start on a :data:`POINTER_ALIGNMENT`-byte boundary (the kernels rely on both).
    """
    tensors = [t for column in columns for t in column]
    device = tensors[0].device
    key = (device, len(columns), *((t.data_ptr(), tuple(t.shape), t.dtype) for t in tensors))
    table = _tables.get(key)
    if table is not None:
        _tables.move_to_end(key)
        return table
    for t in tensors:
        if t.device != device or not t.is_contiguous() or t.data_ptr() % POINTER_ALIGNMENT:
            raise ValueError(f"a pointer table takes contiguous tensors on one device at {POINTER_ALIGNMENT}-byte "
                             f"boundaries, got one of shape {tuple(t.shape)} on {t.device} at {t.data_ptr():#x}")
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("a persistent decode stack's pointer table is built on its first eager call; run one "
                           "step with these weights before capturing a CUDA graph")
    addresses = [[t.data_ptr() for t in column] for column in columns]
    table = torch.tensor(addresses, dtype=torch.int64).to(device)
    _tables[key] = table
    while len(_tables) > TABLE_CACHE_SIZE:
        _tables.popitem(last=False)
    return table


def persistent_grid(device: torch.device, max_items: int) -> int:
    """Programs of a persistent launch whose phases have at most ``max_items`` work items: one per SM of
    ``device`` at most, so that all are resident at once as a grid barrier needs (each must fit an SM alone), and
    no more than the largest phase has items for. One under the interpreter, which runs programs one after another
    (a barrier passes at once only for a single program)."""
    if device.type != "cuda":
        return 1
    return max(1, min(_sm_count(device.index), max_items))


def _sm_count(index: int | None) -> int:
    return torch.cuda.get_device_properties(index if index is not None else torch.cuda.current_device()
                                            ).multi_processor_count


# The table's fields (rows), each a tensor a layer; NORM_W's column i is block i + 1's norm (the last the final one).
IN_W, IN_B, CONV_W, CONV_B, X_W, DT_W, DT_B, SSM_A, SSM_D, OUT_W, OUT_B, NORM_W = (tl.constexpr(f) for f in range(12))
ALL_PHASES = tl.constexpr(0)  # ``phase`` of a whole step's launch; 1, 2, 3: one layer's phase
FINAL_PHASE = tl.constexpr(4)  # the final norm's


@triton.jit
def layer_pointer(table_ptr, field, layer, n_layers, DTYPE: tl.constexpr):
    """Layer ``layer``'s tensor of ``field``: its address in the ``[fields, n_layers]`` table, a pointer to
    ``DTYPE`` marked 16-byte aligned (:func:`pointer_table` checks it) so that loads from it stay 16-byte vectors."""
    address = tl.load(table_ptr + field * n_layers + layer)
    return tl.multiple_of(address.to(tl.pointer_type(DTYPE)), 16)


@triton.jit
def stream_before(stream_ptr, streams_ptr, layer, rows_stride):
    """The residual stream that layer ``layer``'s add (``n_layers``: the final norm's) reads: the one given for
    layer 1, else the buffer of ``streams_ptr`` (two of ``rows_stride``) that layer ``layer - 1`` wrote."""
    if layer == 1:
        stream = stream_ptr
    else:
        stream = streams_ptr + ((layer - 1) % 2) * rows_stride
    return stream


@triton.jit
def _mamba_persistent_kernel(
    normed_ptr, stream_ptr, streams_ptr, delta_ptr, out_ptr, xc_ptr, z_ptr, y_ptr, partial_ptr, table_ptr,
    in_w_ptr, in_b_ptr, conv_w_ptr, conv_b_ptr, x_w_ptr, dt_w_ptr, dt_b_ptr, A_ptr, D_ptr, out_w_ptr, out_b_ptr,
    norm_w_ptr, conv_pool_ptr, ssm_pool_ptr, slot_ids_ptr, counter_ptr,
    batch, d_model, d_inner, n_proj, dt_rank, d_state, n_layers, eps, stride_conv_slot, stride_conv_layer,
    stride_conv_d, stride_ssm_slot, stride_ssm_layer, stride_ssm_d, first_layer, end_layer, phase,
    HAS_BIAS: tl.constexpr, HAS_CONV_BIAS: tl.constexpr, K: tl.constexpr, BB: tl.constexpr, BO: tl.constexpr,
    BK: tl.constexpr, BE: tl.constexpr, BKC: tl.constexpr, BP: tl.constexpr, BR: tl.constexpr, BN: tl.constexpr,
    BC: tl.constexpr, OUT_BO: tl.constexpr, OUT_BK: tl.constexpr, NORM_BN: tl.constexpr, EARLY: tl.constexpr,
    BARRIERS: tl.constexpr,
):
    """Layers ``first_layer`` to ``end_layer`` of a decode step, then the final norm (see the module docstring).
    With ``BARRIERS`` every phase, meeting after each; without, only ``phase`` of one layer (or the final norm),
    for a launch a phase (the interpreter runs programs one after another, so only that runs several)."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    rows_stride = batch * d_model
    in_items = 2 * d_inner // BO
    ssm_items = batch * tl.cdiv(d_inner, BC)
    out_items = tl.cdiv(d_model, OUT_BO)
    for layer in range(first_layer, end_layer):
        in_w = layer_pointer(table_ptr, IN_W, layer, n_layers, in_w_ptr.dtype.element_ty)
        in_b = layer_pointer(table_ptr, IN_B, layer, n_layers, in_b_ptr.dtype.element_ty)
        conv_w = layer_pointer(table_ptr, CONV_W, layer, n_layers, conv_w_ptr.dtype.element_ty)
        conv_b = layer_pointer(table_ptr, CONV_B, layer, n_layers, conv_b_ptr.dtype.element_ty)
        x_w = layer_pointer(table_ptr, X_W, layer, n_layers, x_w_ptr.dtype.element_ty)
        out_w = layer_pointer(table_ptr, OUT_W, layer, n_layers, out_w_ptr.dtype.element_ty)
        conv_pool = conv_pool_ptr + tl.cast(layer, tl.int64) * stride_conv_layer
        barriers = 3 * (layer - first_layer)
        if BARRIERS or phase == 1:
            if layer == 0:  # the block's input is the normed rows given
                for item in range(pid, in_items, programs):
                    mamba_in_proj_item(
                        item, normed_ptr, stream_ptr, normed_ptr, in_w, streams_ptr, in_w, in_b, conv_pool, conv_w,
                        conv_b, slot_ids_ptr, x_w, xc_ptr, z_ptr, partial_ptr, in_w, batch, d_model, d_inner, n_proj,
                        eps, stride_conv_slot, stride_conv_d, 0, False, HAS_BIAS, HAS_CONV_BIAS, K, BB, BO, BK, BE,
                        BKC, False, 1, False, EARLY, False, ".cg",
                    )
            else:  # the residual add (into the stream buffer the previous layer did not write) and the norm
                stream = stream_before(stream_ptr, streams_ptr, layer, rows_stride)
                norm_w = layer_pointer(table_ptr, NORM_W, layer - 1, n_layers, norm_w_ptr.dtype.element_ty)
                for item in range(pid, in_items, programs):
                    mamba_in_proj_item(
                        item, normed_ptr, stream, delta_ptr, norm_w, streams_ptr + (layer % 2) * rows_stride, in_w,
                        in_b, conv_pool, conv_w, conv_b, slot_ids_ptr, x_w, xc_ptr, z_ptr, partial_ptr, in_w, batch,
                        d_model, d_inner, n_proj, eps, stride_conv_slot, stride_conv_d, 0, True, HAS_BIAS,
                        HAS_CONV_BIAS, K, BB, BO, BK, BE, BKC, False, 1, False, EARLY, False, ".cg",
                    )
            if BARRIERS:
                grid_barrier(counter_ptr, (barriers + 1) * programs)
        if BARRIERS or phase == 2:
            dt_w = layer_pointer(table_ptr, DT_W, layer, n_layers, dt_w_ptr.dtype.element_ty)
            dt_b = layer_pointer(table_ptr, DT_B, layer, n_layers, dt_b_ptr.dtype.element_ty)
            A = layer_pointer(table_ptr, SSM_A, layer, n_layers, A_ptr.dtype.element_ty)
            D = layer_pointer(table_ptr, SSM_D, layer, n_layers, D_ptr.dtype.element_ty)
            ssm_pool = ssm_pool_ptr + tl.cast(layer, tl.int64) * stride_ssm_layer
            for item in range(pid, ssm_items, programs):
                mamba_ssm_item(
                    item, partial_ptr, dt_w, dt_b, A, D, xc_ptr, z_ptr, ssm_pool, slot_ids_ptr, y_ptr, dt_w, batch,
                    d_inner, d_inner // BO, dt_rank, d_state, stride_ssm_slot, stride_ssm_d, 0, BP, BR, BN, BC, False,
                    False, EARLY, False, ".cg",
                )
            if BARRIERS:
                grid_barrier(counter_ptr, (barriers + 2) * programs)
        if BARRIERS or phase == 3:
            out_b = layer_pointer(table_ptr, OUT_B, layer, n_layers, out_b_ptr.dtype.element_ty)
            for item in range(pid, out_items, programs):
                mamba_out_proj_item(item, y_ptr, out_w, out_b, delta_ptr, batch, d_inner, d_model, HAS_BIAS, BB,
                                    OUT_BO, OUT_BK, False, 1, EARLY, ".cg")
            if BARRIERS:
                grid_barrier(counter_ptr, (barriers + 3) * programs)
    if BARRIERS or phase == FINAL_PHASE:
        stream = stream_before(stream_ptr, streams_ptr, n_layers, rows_stride)  # the new one: the other buffer
        norm_w = layer_pointer(table_ptr, NORM_W, n_layers - 1, n_layers, norm_w_ptr.dtype.element_ty)
        for row in range(pid, batch, programs):
            residual_rms_norm_row(stream, delta_ptr, norm_w, out_ptr, streams_ptr + (n_layers % 2) * rows_stride,
                                  tl.cast(row, tl.int64), d_model, eps, d_model, d_model, True, False, NORM_BN, ".cg")


def mamba_decode_stack_persistent(
    normed: torch.Tensor,
    stream: torch.Tensor,
    norm_weights: Sequence[torch.Tensor],
    eps: float,
    layers: Sequence[Sequence[torch.Tensor | None]],
    conv_pool: torch.Tensor,
    ssm_pool: torch.Tensor,
    slot_ids: torch.Tensor,
    phase_programs: int | None = None,
) -> torch.Tensor:
    """:func:`~rnnserve.kernels.mamba_decode.fused_recurrent.mamba_decode_stack_triton` in one launch (same
    contract and results; see the module docstring). Every layer's tensors must be contiguous, 16-byte aligned
    and of layer 0's shapes and dtypes, with biases in all layers or none (the model's are).

    ``phase_programs``: instead, a launch per (layer, phase) of that many programs, barriers compiled out (to test
    the items' striding under the interpreter, whose single persistent launch must be one program)."""
    shape = stack_shape(normed, layers)
    first = layers[0]
    for field in (1, 3, 10):
        if len({layer[field] is None for layer in layers}) > 1:
            raise ValueError("the persistent decode stack takes biases in every layer or in none")
    batch, d_model, d_inner, n_proj, x_blocks = shape.batch, shape.d_model, shape.d_inner, shape.n_proj, shape.x_blocks
    dtype, device = first[0].dtype, normed.device
    n_layers = len(layers)
    out_block_o, out_block_k = fused_recurrent.gemv_blocks(shape.batch_block, d_inner, fused_recurrent.OUT_PROJ_ROWS,
                                                           fused_recurrent.OUT_PROJ_TILE)
    # A missing bias's place holds its layer's weight (never read: HAS_BIAS / HAS_CONV_BIAS are off).
    columns = [[layer[f] if layer[f] is not None else layer[weight] for layer in layers]
               for f, weight in ((0, 0), (1, 0), (2, 2), (3, 2), (4, 4), (5, 5), (6, 6), (7, 7), (8, 8), (9, 9),
                                 (10, 9))]
    columns.append(list(norm_weights))
    for column in columns:
        if any(t.shape != column[0].shape or t.dtype != column[0].dtype for t in column):
            raise ValueError("the persistent decode stack takes layers of one shape and dtype")
    table = pointer_table(columns)
    normed = normed.contiguous()
    stream = stream.contiguous()
    streams = torch.empty(2, batch, d_model, dtype=stream.dtype, device=device)
    delta = torch.empty(batch, d_model, dtype=dtype, device=device)
    out = torch.empty(batch, d_model, dtype=norm_weights[-1].dtype, device=device)
    xc = torch.empty(batch, d_inner, dtype=dtype, device=device)
    z, y = torch.empty_like(xc), torch.empty_like(xc)
    partial = torch.empty(x_blocks, batch, n_proj, dtype=torch.float32, device=device)
    counter = torch.zeros(1, dtype=torch.int32, device=device)  # a memset a CUDA graph captures
    slot_ids = slot_ids.long().contiguous()

    def launch(programs: int, first_layer: int, end_layer: int, phase: int) -> None:
        _mamba_persistent_kernel[(programs,)](
            normed, stream, streams, delta, out, xc, z, y, partial, table, *(column[0] for column in columns),
            conv_pool, ssm_pool, slot_ids, counter, batch, d_model, d_inner, n_proj, shape.dt_rank, shape.d_state,
            n_layers, eps, conv_pool.stride(0), conv_pool.stride(1), conv_pool.stride(2), ssm_pool.stride(0),
            ssm_pool.stride(1), ssm_pool.stride(2), first_layer, end_layer, phase, HAS_BIAS=first[1] is not None,
            HAS_CONV_BIAS=first[3] is not None, K=shape.width, BB=shape.batch_block, BO=shape.block_o,
            BK=shape.block_k, BE=shape.block_e, BKC=pow2(shape.width), BP=shape.block_p, BR=shape.block_r,
            BN=shape.block_n, BC=shape.block_c, OUT_BO=out_block_o, OUT_BK=out_block_k, NORM_BN=pow2(d_model),
            EARLY=fused_recurrent.EARLY_LOADS, BARRIERS=phase == ALL_PHASES.value, num_warps=fused_recurrent.NUM_WARPS,
        )

    if phase_programs is None:
        items = max(2 * x_blocks, batch * triton.cdiv(d_inner, shape.block_c), triton.cdiv(d_model, out_block_o),
                    batch)
        launch(persistent_grid(device, items), 0, n_layers, ALL_PHASES.value)
    else:
        for layer in range(n_layers):
            for phase in (1, 2, 3):
                launch(phase_programs, layer, layer + 1, phase)
        launch(phase_programs, n_layers, n_layers, FINAL_PHASE.value)
    return out


__all__ = ["mamba_decode_stack_persistent", "persistent_grid", "pointer_table"]
