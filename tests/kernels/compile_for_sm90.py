"""Compile every Triton kernel for an H100 (sm_90) without a GPU and report its resource use.

Run in a process without ``TRITON_INTERPRET`` (under the interpreter ``@triton.jit`` yields interpreted
functions that cannot be compiled). Prints one JSON line per kernel configuration:
``{"kernel", "config", "registers", "stack", "local"}``.

Each kernel is compiled with the specialization a real launch gets, or its register count is not the one the
GPU runs. Triton's launcher marks each pointer whose address is a multiple of 16 bytes, and each integer that is
a multiple of 16, with ``tt.divisibility = 16`` (which enables vectorised loads and drops address arithmetic),
and compiles an integer equal to 1 as a constant; ``ASTSource`` takes these as ``attrs={(arg index,):
[["tt.divisibility", 16]]}`` and ``constexprs``. Without them the SSD output kernel (bf16, 4 warps) compiled to
234 registers instead of 119. PyTorch allocates on 256-byte boundaries and the wrappers pass whole tensors or column
slices at offsets of multiples of 16 bytes, so every pointer gets the hint (a misaligned launch compiles another,
unhinted variant this check does not cover). Integers get it only where ``LAUNCH_INTS`` gives the values a
wrapper passes at the compiled model size; the others stay unhinted ``i32``, the general case.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from rnnserve.kernels.add_norm.fused import _add_norm_kernel
from rnnserve.kernels.based.chunk import _based_chunk_kernel
from rnnserve.kernels.based.fused_recurrent import _based_step_kernel
from rnnserve.kernels.cached_attention.fused_recurrent import _cached_decode_attention_kernel
from rnnserve.kernels.causal_conv1d.chunk import _conv_edges_kernel, _conv_varlen_kernel
from rnnserve.kernels.causal_conv1d.fused_recurrent import _conv_update_kernel
from rnnserve.kernels.diag_linear_scan.chunk import _diag_scan_varlen_kernel
from rnnserve.kernels.diag_linear_scan.fused_recurrent import _diag_scan_step_kernel
from rnnserve.kernels.gated_rms_norm.fused import _gated_rms_norm_kernel
from rnnserve.kernels.int4_linear.fused import _int4_linear_kernel
from rnnserve.kernels.int4_linear.fused import block_sizes as int4_block_sizes
from rnnserve.kernels.int8_linear.fused import NUM_STAGES as INT8_LINEAR_STAGES
from rnnserve.kernels.int8_linear.fused import _int8_linear_kernel, block_sizes
from rnnserve.kernels.lattice.fused_recurrent import _lattice_decode_kernel, _lattice_prefill_kernel
from rnnserve.kernels.mamba2_decode import fused_recurrent as mamba2_decode
from rnnserve.kernels.mamba2_decode.fused_recurrent import (
    _mamba2_in_proj_kernel,
    _mamba2_out_proj_kernel,
    _mamba2_ssm_kernel,
)
from rnnserve.kernels.mamba2_decode.persistent import _mamba2_persistent_kernel
from rnnserve.kernels.mamba_decode import fused_recurrent as mamba_decode
from rnnserve.kernels.mamba_decode.fused_recurrent import (
    _mamba_in_proj_kernel,
    _mamba_out_proj_kernel,
    _mamba_ssm_kernel,
)
from rnnserve.kernels.mamba_decode.persistent import _mamba_persistent_kernel
from rnnserve.kernels.min_rnn_step.fused_recurrent import _min_rnn_step_kernel
from rnnserve.kernels.residual_rms_norm.fused import _residual_rms_norm_kernel
from rnnserve.kernels.rg_lru.fused_recurrent import CHANNELS as RG_LRU_CHANNELS
from rnnserve.kernels.rg_lru.fused_recurrent import _rg_lru_step_kernel
from rnnserve.kernels.selective_scan.chunk import _segment_state_kernel, _selective_scan_varlen_kernel
from rnnserve.kernels.selective_scan.fused_recurrent import _selective_state_update_kernel
from rnnserve.kernels.sliding_window.chunk import _prefill_warps, _ring_write_kernel, _sw_prefill_kernel
from rnnserve.kernels.sliding_window.fused_recurrent import _sw_decode_kernel
from rnnserve.kernels.soft_cap.fused import BLOCK as SOFT_CAP_BLOCK
from rnnserve.kernels.soft_cap.fused import _soft_cap_kernel
from rnnserve.kernels.ssd.chunk import (
    _ssd_chunk_cb_kernel,
    _ssd_chunk_cumsum_kernel,
    _ssd_chunk_scan_kernel,
    _ssd_chunk_state_kernel,
    _ssd_state_passing_kernel,
)
from rnnserve.kernels.ssd.fused_recurrent import _ssd_state_update_kernel

CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
# Kernels whose wrappers launch them with a num_stages other than Triton's default.
NUM_STAGES = {"_int8_linear_kernel": INT8_LINEAR_STAGES, **dict.fromkeys(
    ["_ssd_chunk_cb_kernel", "_ssd_chunk_state_kernel", "_ssd_chunk_scan_kernel"], 2)}
# Integer arguments as the wrappers pass them at the compiled sizes, for the launch's specialization (see the
# module docstring). mamba2-370m: 32 heads x 64, d_state 128, one group, xBC rows of 2304 (x, B and C are column
# slices of the conv output), fp32 SSD states [B, H, P, N] and a [slots, 48 layers, H, P, N] decode pool; its
# gated norm reads z from in_proj's [T, 4384] output.
_SSD_370M = {"heads": 32, "head_dim": 64, "d_state": 128, "heads_per_group": 32, "groups": 1, "state_size": 8192,
             "stride_dt": 32, "stride_x_t": 2304, "stride_x_h": 64, "stride_B_t": 2304, "stride_B_g": 128,
             "stride_C_t": 2304, "stride_C_g": 128, "stride_h0_slot": 262144, "stride_h0_h": 8192,
             "stride_ht_slot": 262144, "stride_ht_h": 8192, "stride_slot": 48 * 262144, "stride_state_h": 8192,
             "stride_state_p": 128, "stride_x_b": 2304, "stride_B_b": 2304, "stride_C_b": 2304}
# mamba-370m's decode stack: d_model 1024, d_inner 2048, x_proj rows 64 + 2 x 16, conv and SSM pools of 48 layers.
_MAMBA_370M_DECODE = {"d_model": 1024, "d_inner": 2048, "n_proj": 96, "stride_conv_slot": 48 * 2048 * 3,
                      "stride_conv_d": 3, "n_blocks": 128, "dt_rank": 64, "d_state": 16,
                      "stride_ssm_slot": 48 * 2048 * 16, "stride_ssm_d": 16, "n_in": 2048, "n_out": 1024}
# mamba2-370m's decode stack: in_proj rows 2048 + 2304 + 32, 32 heads x 64 channels in blocks of 16.
_MAMBA2_370M_DECODE = {"d_model": 1024, "d_inner": 2048, "conv_dim": 2304, "heads": 32, "head_dim": 64,
                       "d_state": 128, "heads_per_group": 32, "groups": 1, "stride_conv_slot": 48 * 2304 * 3,
                       "stride_conv_d": 3, "stride_ssm_slot": 48 * 32 * 64 * 128, "stride_ssm_h": 64 * 128,
                       "stride_ssm_p": 128, "parts": 128, "parts_per_group": 128, "group_width": 2048}
# mamba-370m's prefill conv reads x, a column slice of in_proj's [T, 4096] output, and its tails in place in the
# pool [slots, 48 layers, 2048, 3]. Its scan: x (the conv output) and dt [T, 2048], z a column slice of in_proj's
# [T, 4096] output, B and C slices of x_proj's [T, 96], states [slots, 48 layers, 2048, 16].
_MAMBA_370M_SCAN = {"dim": 2048, "d_state": 16, "stride_x": 2048, "stride_dt": 2048, "stride_B": 96,
                    "stride_C": 96, "stride_z": 4096, "stride_h0_slot": 48 * 2048 * 16, "stride_h0_d": 16,
                    "stride_ht_slot": 48 * 2048 * 16, "stride_ht_d": 16}
LAUNCH_INTS = {
    **dict.fromkeys(["_conv_varlen_kernel", "_conv_edges_kernel"],
                    {"channels": 2048, "stride_x": 4096, "stride_h0_b": 48 * 2048 * 3, "stride_h0_c": 3,
                     "stride_ht_b": 48 * 2048 * 3, "stride_ht_c": 3}),
    **dict.fromkeys(["_selective_scan_varlen_kernel", "_segment_state_kernel"], _MAMBA_370M_SCAN),
    "_rg_lru_step_kernel": {"width": 128, "dim": 1024, "stride_x": 1024, "stride_y": 1024, "stride_slot": 12 * 1024},
    **dict.fromkeys(["_mamba2_in_proj_kernel", "_mamba2_ssm_kernel", "_mamba2_out_proj_kernel"],
                    _MAMBA2_370M_DECODE),
    # The persistent stack takes the whole pools (a layer's rows at layer * stride) and 48 layers.
    "_mamba2_persistent_kernel": {**_MAMBA2_370M_DECODE, "n_layers": 48, "p_blocks": 4,
                                  "stride_conv_layer": 2304 * 3, "stride_ssm_layer": 32 * 64 * 128},
    **dict.fromkeys(["_mamba_in_proj_kernel", "_mamba_ssm_kernel", "_mamba_out_proj_kernel"], _MAMBA_370M_DECODE),
    # The persistent Mamba-1 stack walks the pools' 48 layers by their strides.
    "_mamba_persistent_kernel": {**_MAMBA_370M_DECODE, "n_layers": 48, "stride_conv_layer": 2048 * 3,
                                 "stride_ssm_layer": 2048 * 16},
    **dict.fromkeys(["_ssd_chunk_cb_kernel", "_ssd_chunk_state_kernel", "_ssd_state_passing_kernel",
                     "_ssd_chunk_scan_kernel", "_ssd_state_update_kernel"], _SSD_370M),
    # The cumsum kernel reads the raw dt columns of in_proj's [T, 4384] output.
    "_ssd_chunk_cumsum_kernel": {**_SSD_370M, "stride_dt": 4384},
    "_gated_rms_norm_kernel": {"width": 2048, "stride_y": 2048, "stride_z": 4384, "stride_out": 2048},
}


def _configs(act: str) -> list[tuple[triton.JITFunction, dict[str, str], dict[str, object], int]]:
    """(kernel, pointer/float argument types, constexprs, num_warps) as the wrappers launch them."""
    f32, i64 = "*fp32", "*i64"
    scan_ptrs = {"a_ptr": act, "b_ptr": act, "h_ptr": f32, "h0_ptr": f32, "ht_ptr": f32, "cu_seqlens_ptr": i64}
    conv_ptrs = {"x_ptr": act, "w_ptr": act, "bias_ptr": act, "h0_ptr": f32, "y_ptr": act,
                 "cu_seqlens_ptr": i64, "seq_idx_ptr": i64}
    norm_ptrs = {"x_ptr": act, "residual_ptr": act, "weight_ptr": act, "bias_ptr": act, "out_ptr": act,
                 "sum_ptr": act, "eps": "fp32"}
    configs = []
    for log_space in (False, True):
        configs.append((_diag_scan_varlen_kernel, scan_ptrs,
                        {"LOG_SPACE": log_space, "HAS_H0": True, "BT": 32, "BD": 32}, 4))
        configs.append((_diag_scan_step_kernel,
                        {"a_ptr": act, "b_ptr": act, "state_ptr": f32, "slot_ids_ptr": i64, "out_ptr": f32},
                        {"LOG_SPACE": log_space, "BD": 1024}, 4))
    configs.append((_conv_varlen_kernel, conv_ptrs, {"K": 4, "HAS_BIAS": True, "HAS_H0": True, "SILU": True,
                                                   "BT": 16, "BC": 128}, 4))
    configs.append((_conv_edges_kernel, {**conv_ptrs, "ht_ptr": f32, "slot_ids_ptr": i64},
                    {"K": 4, "HAS_BIAS": True, "HAS_H0": True, "HAS_SLOTS": True, "SILU": True, "BC": 128, "BK": 4},
                    4))
    configs.append((_conv_update_kernel,
                    {"x_ptr": act, "w_ptr": act, "bias_ptr": act, "state_ptr": f32, "slot_ids_ptr": i64, "y_ptr": act},
                    {"K": 4, "HAS_BIAS": True, "SILU": True, "BC": 256, "BK": 4}, 4))
    for is_lstm in (False, True):
        configs.append((_min_rnn_step_kernel, {"proj_ptr": act, "state_ptr": f32, "slot_ids_ptr": i64, "out_ptr": act},
                        {"IS_LSTM": is_lstm, "BD": 1024}, 4))
    for rms in (False, True):
        configs.append((_add_norm_kernel, norm_ptrs,
                        {"HAS_RESIDUAL": True, "HAS_BIAS": not rms, "RMS": rms, "BN": 8192}, 16))
    configs.append((_residual_rms_norm_kernel,
                    {"stream_ptr": "*fp32", "delta_ptr": act, "weight_ptr": act, "normed_ptr": act,
                     "new_stream_ptr": "*fp32", "eps": "fp32"},
                    {"HAS_DELTA": True, "ROUND_TO_WEIGHT": True, "BN": 4096}, 16))
    configs.append((_soft_cap_kernel, {"x_ptr": act, "out_ptr": "*fp32", "cap": "fp32"}, {"BLOCK": SOFT_CAP_BLOCK}, 4))
    configs.append((_gated_rms_norm_kernel, {"y_ptr": "*fp32", "z_ptr": act, "weight_ptr": act, "out_ptr": act,
                                             "inv_width": "fp32", "eps": "fp32"}, {"BN": 2048}, 8))
    configs += _mamba_configs(act)
    # hawk-100m's RG-LRU: 8 heads of 128 channels.
    configs.append((_rg_lru_step_kernel, {"x_ptr": act, "y_ptr": act, "first_ptr": "*i1", "wi_ptr": act, "bi_ptr": act,
                                          "wr_ptr": act, "br_ptr": act, "param_ptr": act, "pool_ptr": f32,
                                          "slot_ids_ptr": i64, "out_ptr": act}, {"BW": 128, "BC": RG_LRU_CHANNELS}, 4))
    configs += _mamba_decode_configs(act)
    configs += mamba_persistent_configs(act)
    configs += [_mamba2_persistent_config(act, rows) for rows in (1, mamba_decode.MAX_ROWS)]
    configs += _based_configs(act)
    configs += _lattice_configs(act)
    configs += _int8_linear_configs(act)
    configs += _int4_linear_configs(act)
    configs.append((_cached_decode_attention_kernel, {"q_ptr": act, "k_ptr": act, "v_ptr": act, "slot_ids_ptr": i64,
                    "positions_ptr": i64, "out_ptr": f32, "scale": "fp32"}, {"D": 64, "BN": 32, "BD": 64}, 4))
    return configs


def _mamba_configs(act: str) -> list[tuple[triton.JITFunction, dict[str, str], dict[str, object], int]]:
    """Mamba-1 selective scan and Mamba-2 SSD at mamba-370m / mamba2-370m sizes (d_state 16 / 128)."""
    f32, i64 = "*fp32", "*i64"
    flags = {"HAS_DT_BIAS": True, "DT_SOFTPLUS": True, "HAS_D": True, "HAS_Z": True}
    ss = {"x_ptr": act, "dt_ptr": act, "dt_bias_ptr": f32, "A_ptr": f32, "B_ptr": act, "C_ptr": act, "D_ptr": f32,
          "z_ptr": act, "y_ptr": f32, "cu_seqlens_ptr": i64, "h0_ptr": f32, "ht_ptr": f32, "slot_ids_ptr": i64,
          "state_ptr": f32, "seg_ptr": i64, "state_segments_ptr": i64, "seg_state_ptr": f32, "seg_dt_ptr": f32,
          "seg_start_ptr": f32}
    low = act != "*fp32"
    # SSD prefill as ssd_scan_varlen_triton launches it by default: 256-token chunks, [64, 32] score tiles, 4 warps.
    chunked = {"PRECISION": "tf32" if low else "ieee", "L": 256, "BK": 32}
    dots = {"DOT_DTYPE": triton.language.bfloat16 if low else triton.language.float32, **chunked, "BM": 64,
            "BN": 32}
    ssd = {"x_ptr": act, "dt_ptr": f32, "A_ptr": f32, "B_ptr": act, "C_ptr": act, "D_ptr": f32, "y_ptr": f32,
           "chunk_start_ptr": i64, "chunk_end_ptr": i64, "cum_ptr": f32, "cb_ptr": f32, "states_ptr": f32,
           "seq_first_chunk_ptr": i64, "h0_ptr": f32, "ht_ptr": f32, "slot_ids_ptr": i64, "state_ptr": f32}
    return [
        # The model has the prefill scan store y in its activation dtype.
        *((_selective_scan_varlen_kernel, {**ss, "y_ptr": act}, {"HAS_H0": True, "HAS_SLOTS": True, **flags,
                                                                 "SPLIT": split, "BD": 32, "BN": 16}, 1)
          for split in (False, True)),
        (_segment_state_kernel, ss, {"HAS_H0": True, "HAS_SLOTS": True, "HAS_DT_BIAS": True, "DT_SOFTPLUS": True,
                                     "BD": 32, "BN": 16}, 1),
        (_selective_state_update_kernel, ss, {**flags, "BD": 128, "BN": 16}, 4),
        (_ssd_chunk_cumsum_kernel, {**ssd, "dt_ptr": act, "dt_bias_ptr": act, "dt_out_ptr": f32, "dt_min": "fp32",
                                    "dt_max": "fp32"},
         {"HAS_DT_BIAS": True, "DT_SOFTPLUS": True, "DT_LIMIT": False, "L": 256, "BH": 16}, 4),
        (_ssd_chunk_cb_kernel, ssd, dots, 4),
        (_ssd_chunk_state_kernel, ssd, {**chunked, "BP": 64, "BN": 64}, 4),
        (_ssd_state_passing_kernel, ssd, {"HAS_H0": True, "HAS_SLOTS": True, "L": 256, "BLOCK": 512}, 4),
        (_ssd_chunk_scan_kernel, {**ssd, "D_ptr": act}, {"HAS_D": True, "CB_IN_MEMORY": True, **dots, "BP": 64}, 4),
        (_ssd_state_update_kernel, ssd, {"HAS_D": True, "BP": 16, "BN": 128}, 4),
    ]


def _mamba_decode_configs(act: str) -> list[tuple[triton.JITFunction, dict[str, str], dict[str, object], int]]:
    """The Triton Mamba-1 and Mamba-2 decode stacks at mamba-370m / mamba2-370m sizes, batch 1 and the largest
    batch they take, and also with programmatic dependent launch (``PDL``, with the inputs' prefetch and the later
    kernels' weights: ``PREFETCH_AHEAD``, which decode_tune sweeps)."""
    f32 = "*fp32"
    types = {"x_ptr": act, "stream_ptr": f32, "delta_ptr": act, "norm_w_ptr": act, "new_stream_ptr": f32,
             "w_ptr": act, "bias_ptr": act, "conv_pool_ptr": f32, "conv_w_ptr": f32, "conv_b_ptr": f32,
             "slot_ids_ptr": "*i64", "x_proj_w_ptr": act, "xc_ptr": act, "z_ptr": act, "partial_ptr": f32,
             "dt_w_ptr": act, "dt_bias_ptr": f32, "A_ptr": f32, "D_ptr": f32, "ssm_pool_ptr": f32, "y_ptr": act,
             "out_ptr": act, "ahead_ptr": act, "eps": "fp32"}
    types2 = {**types, "conv_w_ptr": act, "conv_b_ptr": act, "xbc_ptr": act, "dt_ptr": act, "A_log_ptr": act,
              "D_ptr": act, "dt_bias_ptr": act, "gated_ptr": f32, "squares_ptr": f32, "dt_min": "fp32",
              "dt_max": "fp32"}
    weight_bytes = 4 if act == "*fp32" else 2

    def lines(block_o: int, row_len: int) -> int:
        return mamba_decode.l2_lines(block_o, row_len * weight_bytes)

    configs = []
    gemv_warps, gemv2_warps = mamba_decode.NUM_WARPS, mamba2_decode.NUM_WARPS
    for rows, pdl in ((1, False), (mamba_decode.MAX_ROWS, False), (1, True), (mamba_decode.MAX_ROWS, True)):
        block_o, block_k, block_e = mamba_decode.in_proj_blocks(rows, 1024, 2048, 96)
        configs.append((_mamba_in_proj_kernel, types, {"HAS_NORM": True, "HAS_BIAS": True, "HAS_CONV_BIAS": True,
                                                       "K": 4, "BB": rows, "BO": block_o, "BK": block_k,
                                                       "BE": block_e, "BKC": 4, "PDL": pdl,
                                                       "LINES": lines(block_o, 1024), "PREFETCH": pdl,
                                                       "EARLY": mamba_decode.EARLY_LOADS,
                                                       "AHEAD": pdl},
                        gemv_warps))
        block_o, block_k = mamba_decode.gemv_blocks(rows, 2048, mamba_decode.OUT_PROJ_ROWS, mamba_decode.OUT_PROJ_TILE)
        configs.append((_mamba_out_proj_kernel, {**types, "x_ptr": act}, {"HAS_BIAS": True, "BB": rows,
                                                                          "BO": block_o, "BK": block_k, "PDL": pdl,
                                                                          "LINES": lines(block_o, 2048),
                                                                          "EARLY": mamba_decode.EARLY_LOADS},
                        gemv_warps))
        block_o, block_k = mamba_decode.gemv_blocks(rows, 1024, mamba2_decode.IN_PROJ_ROWS, mamba2_decode.TILE)
        configs.append((_mamba2_in_proj_kernel, types2, {"HAS_NORM": True, "HAS_BIAS": True, "HAS_CONV_BIAS": True,
                                                         "K": 4, "BB": rows, "BO": block_o, "BK": block_k,
                                                         "BKC": 4, "PDL": pdl, "LINES": lines(block_o, 1024),
                                                         "PREFETCH": pdl, "EARLY": mamba2_decode.EARLY_LOADS,
                                                         "AHEAD": pdl},
                        gemv2_warps))
        block_o, block_k = mamba_decode.gemv_blocks(rows, 2048, mamba2_decode.OUT_PROJ_ROWS,
                                                    mamba2_decode.OUT_PROJ_TILE)
        configs.append((_mamba2_out_proj_kernel, types2, {"HAS_BIAS": True, "BB": rows, "BO": block_o,
                                                          "BK": block_k, "BQ": 128, "BG": 1, "PDL": pdl,
                                                          "LINES": lines(block_o, 2048), "PREFETCH": pdl,
                                                          "EARLY": mamba2_decode.EARLY_LOADS},
                        gemv2_warps))
    for pdl in (False, True):
        configs.append((_mamba_ssm_kernel, types, {"BP": 64, "BR": 64, "BN": 16, "BC": mamba_decode.SSM_CHANNELS,
                                                   "PDL": pdl, "PREFETCH": pdl, "EARLY": mamba_decode.EARLY_LOADS,
                                                   "AHEAD": pdl},
                        mamba_decode.SSM_WARPS))
        configs.append((_mamba2_ssm_kernel, types2, {"BP": mamba2_decode.SSM_CHANNELS, "BN": 128, "PDL": pdl,
                                                     "AHEAD": pdl},
                        mamba2_decode.SSM_WARPS))
    return configs


def mamba_persistent_configs(act: str) -> list[tuple[triton.JITFunction, dict[str, str], dict[str, object], int]]:
    """The persistent Mamba-1 decode stack at mamba-370m's sizes, batch 1 and the largest batch, as
    ``mamba_decode_stack_persistent`` launches a whole step (barriers in)."""
    f32 = "*fp32"
    types = {"normed_ptr": act, "stream_ptr": f32, "streams_ptr": f32, "delta_ptr": act, "out_ptr": act,
             "xc_ptr": act, "z_ptr": act, "y_ptr": act, "partial_ptr": f32, "table_ptr": "*i64", "in_w_ptr": act,
             "in_b_ptr": act, "conv_w_ptr": f32, "conv_b_ptr": f32, "x_w_ptr": act, "dt_w_ptr": act,
             "dt_b_ptr": f32, "A_ptr": f32, "D_ptr": f32, "out_w_ptr": act, "out_b_ptr": act, "norm_w_ptr": act,
             "conv_pool_ptr": f32, "ssm_pool_ptr": f32, "slot_ids_ptr": "*i64", "counter_ptr": "*i32",
             "eps": "fp32"}
    configs = []
    for rows in (1, mamba_decode.MAX_ROWS):
        block_o, block_k, block_e = mamba_decode.in_proj_blocks(rows, 1024, 2048, 96)
        out_block_o, out_block_k = mamba_decode.gemv_blocks(rows, 2048, mamba_decode.OUT_PROJ_ROWS,
                                                            mamba_decode.OUT_PROJ_TILE)
        configs.append((_mamba_persistent_kernel, types,
                        {"HAS_BIAS": True, "HAS_CONV_BIAS": True, "K": 4, "BB": rows, "BO": block_o, "BK": block_k,
                         "BE": block_e, "BKC": 4, "BP": 64, "BR": 64, "BN": 16, "BC": mamba_decode.SSM_CHANNELS,
                         "OUT_BO": out_block_o, "OUT_BK": out_block_k, "NORM_BN": 1024,
                         "EARLY": mamba_decode.EARLY_LOADS, "BARRIERS": True},
                        mamba_decode.NUM_WARPS))
    return configs


def _mamba2_persistent_config(
    act: str, rows: int, phase: int = -1
) -> tuple[triton.JITFunction, dict[str, str], dict[str, object], int]:
    """The persistent Mamba-2 decode stack at mamba2-370m sizes for ``rows`` sequences: the whole step (``phase``
    -1) or one phase."""
    f32 = "*fp32"
    types = {"x_ptr": act, "stream_ptr": f32, "streams_ptr": f32, "delta_ptr": act, "final_w_ptr": act,
             "out_ptr": act, "table_ptr": "*i64", "conv_pool_ptr": f32, "ssm_pool_ptr": f32, "slot_ids_ptr": "*i64",
             "z_ptr": act, "xbc_ptr": act, "dt_ptr": act, "gated_ptr": f32, "squares_ptr": f32, "counter_ptr": "*i32",
             "eps": "fp32", "gated_eps": "fp32", "dt_min": "fp32", "dt_max": "fp32"}
    block_o, block_k = mamba_decode.gemv_blocks(rows, 1024, mamba2_decode.IN_PROJ_ROWS, mamba2_decode.TILE)
    out_block_o, out_block_k = mamba_decode.gemv_blocks(rows, 2048, mamba2_decode.OUT_PROJ_ROWS,
                                                        mamba2_decode.OUT_PROJ_TILE)
    constexprs = {"HAS_BIAS": True, "HAS_CONV_BIAS": True, "HAS_OUT_BIAS": True, "K": 4, "BB": rows, "BO": block_o,
                  "BK": block_k, "BKC": 4, "BP": mamba2_decode.SSM_CHANNELS, "BN": 128, "OUT_BO": out_block_o,
                  "OUT_BK": out_block_k, "BQ": 128, "BG": 1, "BM": 1024, "EARLY": mamba2_decode.EARLY_LOADS,
                  "PHASE": phase}
    return _mamba2_persistent_kernel, types, constexprs, mamba2_decode.NUM_WARPS


def mamba2_persistent_asm(act: str) -> dict[str, str]:
    """The TTIR and PTX (``{"ttir": ..., "ptx": ...}``) of the persistent Mamba-2 stack's whole step at batch 1."""
    kernel, types, constexprs, num_warps = _mamba2_persistent_config(act, 1)
    names = kernel.arg_names
    signature, constexprs, attrs = _specialize(kernel, types, constexprs)
    source = ASTSource(kernel, signature, constexprs={(names.index(k),): v for k, v in constexprs.items()},
                       attrs=attrs)
    asm = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps}).asm
    return {"ttir": asm["ttir"], "ptx": asm["ptx"]}


def _based_configs(act: str) -> list[tuple[triton.JITFunction, dict[str, str], dict[str, object], int]]:
    """Based-360m's Taylor linear attention (feature dim 16, head_dim 64) and sliding window (head_dim 64; 112
    for based-1b), as the wrappers launch them."""
    f32, i64 = "*fp32", "*i64"
    based = {"q_ptr": act, "k_ptr": act, "v_ptr": act, "o_ptr": f32, "s0_ptr": f32, "z0_ptr": f32, "st_ptr": f32,
             "zt_ptr": f32, "s_ptr": f32, "z_ptr": f32, "cu_seqlens_ptr": i64, "slot_ids_ptr": i64,
             "sqrt_scale": "fp32", "quad_scale": "fp32", "scale": "fp32", "eps": "fp32"}
    window = {"q_ptr": act, "k_ptr": act, "v_ptr": act, "o_ptr": f32, "kc_ptr": f32, "vc_ptr": f32, "kp_ptr": f32,
              "vp_ptr": f32, "cu_seqlens_ptr": i64, "starts_ptr": i64, "positions_ptr": i64, "slot_ids_ptr": i64,
              "scale": "fp32"}
    low = act != "*fp32"
    dots = {"DOT_DTYPE": triton.language.bfloat16 if low else triton.language.float32,
            "PRECISION": "tf32" if low else "ieee"}
    configs = [
        (_based_chunk_kernel, based, {"FP": 16, "BT": 16, "BV": 16}, 8),
        (_based_step_kernel, based, {"FP": 16, "BV": 64}, 4),
        (_ring_write_kernel, window, {"BW": 16, "BD": 64}, 4),
        (_sw_decode_kernel, window, {"GROUP": 1, "BW": 32, "BD": 128}, 4),
    ]
    for block_d in (64, 128):
        warps = _prefill_warps(block_d, dots["DOT_DTYPE"])
        configs.append((_sw_prefill_kernel, window, {"GROUP": 1, "BQ": 16, "BK": 16, "BD": block_d, **dots}, warps))
    return configs


def _lattice_configs(act: str) -> list[tuple[triton.JITFunction, dict[str, str], dict[str, object], int]]:
    """Lattice's fused prefill and decode with the state on chip, as the wrappers launch them: lattice-110m/340m
    heads (d = m = 64, 16 warps) in every variant, and a d = 128, m = 32 head (the wrappers pass fp32 inputs)."""
    f32, i64 = "*fp32", "*i64"
    types = {"q_ptr": f32, "k_ptr": f32, "v_ptr": f32, "gamma_ptr": f32, "mu_ptr": f32, "y_ptr": f32,
             "state_ptr": f32, "slot_ids_ptr": i64, "cu_seqlens_ptr": i64}
    shapes = [(variant, True, 64, 64) for variant in range(3)] + [(0, False, 64, 64), (0, True, 128, 32)]
    return [
        (kernel, types, {"VARIANT": variant, "NORMALIZE": norm, "HAS_MU": True, "BD": block_d, "BM": block_m}, 16)
        for kernel in (_lattice_prefill_kernel, _lattice_decode_kernel)
        for variant, norm, block_d, block_m in shapes
    ]

def _int8_linear_configs(act: str) -> list[tuple[triton.JITFunction, dict[str, str], dict[str, object], int]]:
    """The w8a16 linear at both of the wrapper's block shapes (decode batches, larger batches)."""
    types = {"x_ptr": act, "w_ptr": "*i8", "scale_ptr": "*fp32", "bias_ptr": act, "y_ptr": act}
    low = act != "*fp32"
    dot = {"DOT_DTYPE": triton.language.bfloat16 if low else triton.language.float32,
           "PRECISION": "tf32" if low else "ieee"}
    configs = []
    for rows in (1, 512):
        block_m, block_n, block_k, warps = block_sizes(rows)
        configs.append((_int8_linear_kernel, types, {"HAS_BIAS": True, **dot, "BM": block_m, "BN": block_n,
                                                     "BK": block_k}, warps))
    return configs


def _int4_linear_configs(act: str) -> list[tuple[triton.JITFunction, dict[str, str], dict[str, object], int]]:
    """The w4a16 linear at both of the wrapper's block shapes (decode batches, larger batches)."""
    types = {"x_ptr": act, "w_ptr": "*u8", "scale_ptr": "*fp16", "bias_ptr": act, "y_ptr": act}
    low = act != "*fp32"
    dot = {"DOT_DTYPE": triton.language.bfloat16 if low else triton.language.float32,
           "PRECISION": "tf32" if low else "ieee"}
    configs = []
    for rows in (1, 512):
        block_m, block_n, warps = int4_block_sizes(rows, not low)
        configs.append((_int4_linear_kernel, types, {"HAS_BIAS": True, **dot, "BM": block_m, "BN": block_n}, warps))
    return configs


def _specialize(
    kernel: triton.JITFunction, types: dict[str, str], constexprs: dict[str, object]
) -> tuple[dict[str, str], dict[str, object], dict[tuple[int], list[list[object]]]]:
    """(signature, constexprs, attributes) as Triton's launcher specializes an aligned launch: every pointer and
    every integer of ``LAUNCH_INTS`` that is a multiple of 16 gets ``tt.divisibility = 16``; one equal to 1 becomes
    a constexpr. Other integers are plain ``i32``."""
    ints = LAUNCH_INTS.get(kernel.__name__, {})
    names = kernel.arg_names
    constexprs = {**constexprs, **{n: 1 for n in names if ints.get(n) == 1 and n not in constexprs}}
    signature = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in names}
    divisible = [n for n in names if signature[n].startswith("*") or (signature[n] == "i32" and n in ints
                                                                       and ints[n] % 16 == 0)]
    return signature, constexprs, {(names.index(n),): [["tt.divisibility", 16]] for n in divisible}


def compile_sm90(
    kernel: triton.JITFunction, types: dict[str, str], constexprs: dict[str, object], num_warps: int
) -> tuple[bytes, dict[str, object]]:
    """``(cubin, constexprs as specialized)`` of one configuration, compiled for sm_90 as a launch compiles it."""
    names = kernel.arg_names
    signature, constexprs, attrs = _specialize(kernel, types, constexprs)
    source = ASTSource(kernel, signature, constexprs={(names.index(k),): v for k, v in constexprs.items()},
                       attrs=attrs)
    options = {"num_warps": num_warps}
    if kernel.__name__ in NUM_STAGES:
        options["num_stages"] = NUM_STAGES[kernel.__name__]
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm["cubin"], constexprs


def cuobjdump(cubin: bytes, flag: str) -> str:
    """``cuobjdump <flag>`` of ``cubin`` (``-res-usage``: registers and stack; ``-sass``: the machine code)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        return subprocess.run([CUOBJDUMP, flag, file.name], capture_output=True, text=True, check=True).stdout


def main() -> None:
    for act in ("*fp32", "*bf16"):
        for kernel, types, constexprs, num_warps in _configs(act):
            cubin, constexprs = compile_sm90(kernel, types, constexprs, num_warps)
            usage = cuobjdump(cubin, "-res-usage")
            resources = {k: int(v) for k, v in re.findall(r"(REG|STACK|LOCAL):(\d+)", usage)}
            config = {"act": act, **{k: str(v) for k, v in constexprs.items()}}
            print(json.dumps({"kernel": kernel.__name__, "config": config, "registers": resources["REG"],
                              "stack": resources["STACK"], "local": resources["LOCAL"]}))


if __name__ == "__main__":
    main()
