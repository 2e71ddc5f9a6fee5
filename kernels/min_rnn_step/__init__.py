"""Fused minGRU / minLSTM decode step (gate activations + recurrence + in-place state write).

``naive.py`` holds the PyTorch reference and the gate formulas the models share; ``fused_recurrent.py`` the
Triton kernel; ``min_rnn_step_cpu.cpp`` the fused CPU ops (fp32 or bf16 ``proj``, fp32 states): the step and
the prefill scan. Prefill elsewhere uses the same gates in log space with
:func:`rnnserve.kernels.diag_linear_scan.diag_log_scan`.
"""

from __future__ import annotations

import torch

from rnnserve.kernels.backend import use_triton
from rnnserve.kernels.cpu_extension import use_cpu_kernel
from rnnserve.kernels.diag_linear_scan import diag_log_scan
from rnnserve.kernels.min_rnn_step.naive import (
    COEFFICIENTS,
    LOG_COEFFICIENTS,
    g,
    log_g,
    min_rnn_step_ref,
    mingru_coefficients,
    mingru_log_coefficients,
    minlstm_coefficients,
    minlstm_log_coefficients,
)


def _cpu_op_applies(proj: torch.Tensor, state: torch.Tensor) -> bool:
    return (
        proj.dim() == 2
        and proj.dtype in (torch.float32, torch.bfloat16)
        and proj.stride(1) == 1
        and state.dim() == 2
        and state.dtype == torch.float32
        and state.stride(1) == 1
        and not torch.is_grad_enabled()
        and use_cpu_kernel(proj)
    )


def min_rnn_step(proj: torch.Tensor, state: torch.Tensor, slot_ids: torch.Tensor, cell: str) -> torch.Tensor:
    """Advance ``cell`` (``"mingru"``/``"minlstm"``) by one token for each row of ``proj [B, P * D]``.

    ``state`` is a fp32 pool ``[N, D]`` (a strided view such as ``pool[:, layer]`` is fine); rows ``slot_ids``
    are updated in place. Returns the new hidden state ``[B, D]`` in ``proj``'s dtype.
    """
    if use_triton(proj):
        from rnnserve.kernels.min_rnn_step.fused_recurrent import min_rnn_step_triton

        return min_rnn_step_triton(proj, state, slot_ids, cell)
    if cell in COEFFICIENTS and _cpu_op_applies(proj, state):
        return torch.ops.rnnserve.min_rnn_step(proj, state, slot_ids.long().contiguous(), cell == "minlstm")
    h = min_rnn_step_ref(proj, state[slot_ids], cell)
    state[slot_ids] = h
    return h.to(proj.dtype)


def min_rnn_scan(
    proj: torch.Tensor, cu_seqlens: torch.Tensor, initial_state: torch.Tensor, cell: str, chunk_size: int = 64
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed varlen prefill of ``cell`` over ``proj [T, P * D]`` from ``initial_state [B, D]`` (not written):
    ``(h [T, D], final_state [B, D])`` in fp32. On CPU one fused op (the decode step's gates, token by token);
    elsewhere, and with autograd, the log-space gates through
    :func:`~rnnserve.kernels.diag_linear_scan.diag_log_scan` (``chunk_size`` applies to its PyTorch path)."""
    if _cpu_op_applies(proj, initial_state):
        final = initial_state.float().contiguous().clone()
        cu = cu_seqlens.long().contiguous()
        return torch.ops.rnnserve.min_rnn_scan(proj, cu, final, cell == "minlstm"), final
    log_a, log_b = LOG_COEFFICIENTS[cell](proj)
    return diag_log_scan(log_a, log_b, cu_seqlens, initial_state, chunk_size=chunk_size)


__all__ = [
    "min_rnn_scan",
    "min_rnn_step",
    "g",
    "log_g",
    "mingru_coefficients",
    "mingru_log_coefficients",
    "minlstm_coefficients",
    "minlstm_log_coefficients",
]
