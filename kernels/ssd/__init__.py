"""Mamba-2 SSD: chunked varlen prefill and the in-place decode state update.

``naive.py`` is the token-by-token reference; ``chunk.py`` (chunked varlen prefill: chunk states, state
passing and chunk outputs as three kernels) and ``fused_recurrent.py`` (slot-addressed decode update) the
Triton kernels used on CUDA; ``torch_chunked.py`` (the SSD algorithm as a handful of batched matmuls) and
``torch_recurrent.py`` (in-place update) the PyTorch paths on every other device, except the decode update
on CPU: ``ssd_cpu.cpp`` does it in one pass over the state (fp32 pool with each slot contiguous).
"""

from __future__ import annotations

import torch

from rnnserve.kernels.backend import on_pool_rows, slot_tensor, use_triton
from rnnserve.kernels.cpu_extension import use_cpu_kernel
from rnnserve.kernels.ssd.naive import discretize_dt
from rnnserve.kernels.ssd.torch_chunked import ssd_scan_chunked
from rnnserve.kernels.ssd.torch_recurrent import ssd_state_update_torch


def ssd_scan_varlen(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    cu_seqlens: torch.Tensor,
    D: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = 64,
    *,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    slot_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed varlen SSD prefill; same contract as :func:`~rnnserve.kernels.ssd.naive.ssd_scan_ref` on
    ``discretize_dt(dt, dt_bias, dt_softplus, dt_limit)`` (the Triton kernels discretise ``dt`` in-kernel).
    With ``slot_ids`` ``initial_state`` is an fp32 state pool ``[num_slots, H, P, N]`` whose rows ``slot_ids``
    are read and overwritten in place; the pool is returned as the final state.

    ``chunk_size`` applies to the PyTorch path; the Triton kernels use their own 256-token chunks and the CPU
    kernel none (any chunk size gives the same result up to rounding)."""
    check_groups(x.shape[-2], B.shape[-2])
    if use_triton(x):
        from rnnserve.kernels.ssd.chunk import ssd_scan_varlen_triton

        return ssd_scan_varlen_triton(x, dt, A, B, C, cu_seqlens, D, initial_state, slot_ids=slot_ids,
                                      dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit)
    dt = discretize_dt(dt, dt_bias, dt_softplus, dt_limit)
    if _cpu_scan_applies(x, B, C, initial_state, slot_ids) and use_cpu_kernel(x):
        batch = cu_seqlens.numel() - 1
        if slot_ids is None:
            state_shape = (batch, *x.shape[1:], B.shape[-1])
            pool = torch.zeros(state_shape) if initial_state is None else initial_state.float().contiguous().clone()
            slot_ids = torch.arange(batch)
        else:
            pool = initial_state
        y = torch.ops.rnnserve.ssd_scan_varlen(x, dt.contiguous(), A.float().contiguous(), B, C,
                                               None if D is None else D.float(), cu_seqlens.long().contiguous(),
                                               pool, slot_ids.long().contiguous())  # fmt: skip
        return y, pool
    if slot_ids is not None:
        return on_pool_rows(lambda h0: ssd_scan_chunked(x, dt, A, B, C, cu_seqlens, D, h0, chunk_size),
                            initial_state, slot_ids)
    return ssd_scan_chunked(x, dt, A, B, C, cu_seqlens, D, initial_state, chunk_size)


def ssd_state_update(
    state: torch.Tensor,
    slots: torch.Tensor | slice,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    slot_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """One decode step on pool rows ``state[slots]`` in place (see :func:`ssd_state_update_torch`);
    ``slot_ids`` are ``slots`` as an int64 tensor when the caller holds them."""
    check_groups(x.shape[-2], B.shape[-2])
    if use_triton(x):
        from rnnserve.kernels.ssd.fused_recurrent import ssd_state_update_triton

        if slot_ids is None:
            slot_ids = slot_tensor(slots, state, x.device)
        return ssd_state_update_triton(state, slot_ids, x, dt, A, B, C, D)
    if _cpu_op_applies(state, x, dt, A, B, C) and use_cpu_kernel(x):
        if slot_ids is None:
            slot_ids = slot_tensor(slots, state)
        return torch.ops.rnnserve.ssd_state_update(state, slot_ids.long().contiguous(), x, dt, A.contiguous(), B, C, D)
    return ssd_state_update_torch(state, slots, x, dt, A, B, C, D)


def check_groups(heads: int, groups: int) -> None:
    """Heads share B and C in equal groups (Mamba-2's ``ngroups`` divides ``nheads``); any other count would read
    past B and C."""
    if groups < 1 or heads % groups:
        raise ValueError(f"{heads} heads cannot share {groups} B/C groups in equal groups")


def _cpu_scan_applies(
    x: torch.Tensor, B: torch.Tensor, C: torch.Tensor, initial_state: torch.Tensor | None,
    slot_ids: torch.Tensor | None,
) -> bool:
    """The CPU prefill's layouts: unit strides along ``P`` and ``N`` (B and C as views of one tensor), and with
    ``slot_ids`` an fp32 pool with each slot's ``[H, P, N]`` contiguous."""
    if x.dim() != 3 or B.dim() != 3 or torch.is_grad_enabled():
        return False
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16) or not B.dtype == C.dtype == x.dtype:
        return False
    if x.stride(-1) != 1 or B.stride(-1) != 1 or B.stride() != C.stride():
        return False
    return slot_ids is None or _slots_contiguous(initial_state)


def _slots_contiguous(pool: torch.Tensor) -> bool:
    """An fp32 state pool ``[S, H, P, N]`` with each slot's ``[H, P, N]`` contiguous (any slot stride)."""
    head_dim, d_state = pool.shape[2:]
    return (
        pool.dtype == torch.float32
        and pool.stride(-1) == 1
        and pool.stride(-2) == d_state
        and pool.stride(-3) == head_dim * d_state
    )


def _cpu_op_applies(
    state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor
) -> bool:
    """The CPU op's layout and dtypes: an fp32 pool with each slot's ``[H, P, N]`` contiguous, fp32 ``dt``/``A``."""
    if state.dim() != 4 or x.dim() != 3:
        return False
    return (
        _slots_contiguous(state)
        and all(t.dtype in (torch.float32, torch.bfloat16) for t in (x, B, C))
        and dt.dtype == torch.float32
        and A.dtype == torch.float32
        and not torch.is_grad_enabled()
    )


__all__ = ["discretize_dt", "ssd_scan_varlen", "ssd_state_update"]
