"""Gated diagonal linear recurrence ``h_t = a_t * h_{t-1} + b_t`` in linear and log space.

Serves minGRU, minLSTM, RG-LRU and diagonal linear RNNs. ``naive.py`` is the PyTorch reference,
``chunk.py`` the Triton varlen prefill (chunked scan), ``fused_recurrent.py`` the Triton decode step and
``diag_linear_scan_cpu.cpp`` the CPU prefill scan (sequential in time, channels in vector lanes, both spaces).
"""

from __future__ import annotations

import torch

from rnnserve.kernels.backend import use_triton
from rnnserve.kernels.cpu_extension import use_cpu_kernel
from rnnserve.kernels.diag_linear_scan.naive import diag_linear_scan_ref, diag_log_scan_ref, diag_scan_step_ref


def diag_linear_scan(
    a: torch.Tensor,
    b: torch.Tensor,
    cu_seqlens: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed ``a, b [T, D]`` -> ``(h [T, D], final_state [B, D])`` in fp32; ``initial_state [B, D]``.

    Triton on CUDA, the C++ kernel on CPU (``chunk_size`` is Triton's), else the reference."""
    if use_triton(a):
        from rnnserve.kernels.diag_linear_scan.chunk import diag_scan_varlen_triton

        return diag_scan_varlen_triton(a, b, cu_seqlens, initial_state, False, chunk_size)
    if use_cpu_kernel(a) and not _needs_grad(a, b, initial_state):
        return torch.ops.rnnserve.diag_scan_varlen(a, b, cu_seqlens, initial_state, False)
    return diag_linear_scan_ref(a, b, cu_seqlens, initial_state)


def diag_log_scan(
    log_a: torch.Tensor,
    log_b: torch.Tensor,
    cu_seqlens: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-space variant for positive states: ``h_t = exp(log_a_t) h_{t-1} + exp(log_b_t)``.

    ``initial_state`` is the linear-space state (>= 0); returns linear-space ``(h, final_state)``.
    """
    if use_triton(log_a):
        from rnnserve.kernels.diag_linear_scan.chunk import diag_scan_varlen_triton

        return diag_scan_varlen_triton(log_a, log_b, cu_seqlens, initial_state, True, chunk_size)
    if use_cpu_kernel(log_a) and not _needs_grad(log_a, log_b, initial_state):
        return torch.ops.rnnserve.diag_scan_varlen(log_a, log_b, cu_seqlens, initial_state, True)
    return diag_log_scan_ref(log_a, log_b, cu_seqlens, initial_state, chunk_size=chunk_size)


def diag_scan_step(
    a: torch.Tensor, b: torch.Tensor, state: torch.Tensor, slot_ids: torch.Tensor, log_space: bool = False
) -> torch.Tensor:
    """Decode step in place: ``state[slot_ids] = a * state[slot_ids] + b``; returns ``h [B, D]``.

    ``state`` is a pool ``[N, D]`` in fp32 (a strided view such as ``pool[:, layer]`` is fine);
    ``a, b [B, D]`` are logs when ``log_space``.
    """
    if use_triton(a):
        from rnnserve.kernels.diag_linear_scan.fused_recurrent import diag_scan_step_triton

        return diag_scan_step_triton(a, b, state, slot_ids, log_space)
    h = diag_scan_step_ref(a, b, state[slot_ids], log_space)
    state[slot_ids] = h
    return h


def _needs_grad(*tensors: torch.Tensor | None) -> bool:
    """The CPU kernel has no autograd formula."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


__all__ = ["diag_linear_scan", "diag_log_scan", "diag_scan_step"]
