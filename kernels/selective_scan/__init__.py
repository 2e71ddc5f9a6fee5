"""Mamba-1 selective scan: varlen prefill and the decode state update on state-pool slots.

``naive.py`` is the token-by-token reference; ``chunk.py`` (varlen prefill, chunked parallel scan with the
state on chip) and ``fused_recurrent.py`` (slot-addressed decode update) the Triton kernels used on CUDA;
``selective_scan_cpu.cpp`` fused C++ kernels for both (see :mod:`rnnserve.kernels.cpu_extension`), used on
CPU whenever they compile; ``torch_chunked.py`` (time-major chunks, one fused op per step) and
``torch_recurrent.py`` (in-place update) the PyTorch paths for every other case. The two public functions
pick the fastest available path.
"""

from __future__ import annotations

import torch

from rnnserve.kernels.backend import on_pool_rows, slot_tensor, use_triton
from rnnserve.kernels.cpu_extension import use_cpu_kernel
from rnnserve.kernels.selective_scan.torch_chunked import selective_scan_chunked
from rnnserve.kernels.selective_scan.torch_recurrent import selective_state_update_torch

_ACTIVATION_DTYPES = (torch.float32, torch.bfloat16)


def _f32(t: torch.Tensor | None) -> torch.Tensor | None:
    """A parameter as the C++ kernels read it: fp32 contiguous (``None`` stays absent)."""
    return None if t is None else t.float().contiguous()


def _activations(x: torch.Tensor, *others: torch.Tensor | None) -> list[torch.Tensor | None]:
    """``x`` and ``others`` in one dtype (``x``'s if fp32 or bf16, else fp32; any strides), as the C++ kernels
    read them."""
    dtype = x.dtype if x.dtype in _ACTIVATION_DTYPES else torch.float32
    return [None if t is None else t.to(dtype) for t in (x, *others)]


def _fused(x: torch.Tensor, A: torch.Tensor) -> bool:
    return use_cpu_kernel(x) and A.shape[1] <= 64 and x.dim() == 2


def selective_scan_varlen(
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
    chunk_size: int = 32,
    out_dtype: torch.dtype = torch.float32,
    slot_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed varlen selective scan; same contract as
    :func:`~rnnserve.kernels.selective_scan.naive.selective_scan_ref`, with ``y`` rounded to ``out_dtype``
    (computed in fp32 either way). ``chunk_size`` applies to the PyTorch path only. With ``slot_ids``
    ``initial_state`` is an fp32 state pool ``[num_slots, Di, N]`` whose rows ``slot_ids`` are read and
    overwritten in place; the pool is returned as the final state."""
    if use_triton(x):
        from rnnserve.kernels.selective_scan.chunk import selective_scan_varlen_triton

        return selective_scan_varlen_triton(
            x, dt, A, B, C, cu_seqlens, D, z, initial_state, dt_bias, dt_softplus, slot_ids, out_dtype=out_dtype
        )
    if slot_ids is not None:
        return on_pool_rows(
            lambda h0: selective_scan_varlen(
                x, dt, A, B, C, cu_seqlens, D, z, h0, dt_bias, dt_softplus, chunk_size, out_dtype
            ),
            initial_state,
            slot_ids,
        )
    if not _fused(x, A):
        y, final = selective_scan_chunked(
            x, dt, A, B, C, cu_seqlens, D, z, initial_state, dt_bias, dt_softplus, chunk_size
        )
        return y.to(out_dtype), final
    batch = cu_seqlens.numel() - 1
    if initial_state is None:
        state = x.new_zeros((batch, *A.shape), dtype=torch.float32)
    else:
        state = initial_state.to(torch.float32, copy=True).contiguous()
    x, dt, B, C, z = _activations(x, dt, B, C, z)
    y = torch.ops.rnnserve.selective_scan(
        x, dt, _f32(dt_bias), _f32(A), B, C, _f32(D), z, cu_seqlens.long().contiguous(), state, dt_softplus
    )
    return y.to(out_dtype), state


def selective_state_update(
    state: torch.Tensor,
    slots: torch.Tensor | slice,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
    slot_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """One decode step on pool rows ``state[slots]`` in place (see :func:`selective_state_update_torch`).

    ``slot_ids``, when given, are ``slots`` as an int64 tensor (the fused kernel takes ids; a caller that holds
    them saves building them from a slice every layer)."""
    if use_triton(x):
        from rnnserve.kernels.selective_scan.fused_recurrent import selective_state_update_triton

        if slot_ids is None:
            slot_ids = slot_tensor(slots, state, x.device)
        return selective_state_update_triton(state, slot_ids, x, dt, A, B, C, D, z, dt_bias, dt_softplus)
    d_state = A.shape[1]
    fused = (
        _fused(x, A)
        and state.dtype == torch.float32
        and state.stride(-1) == 1
        and state.stride(-2) == d_state
    )
    if not fused:
        return selective_state_update_torch(state, slots, x, dt, A, B, C, D, z, dt_bias, dt_softplus)
    if slot_ids is None:
        slot_ids = slot_tensor(slots, state)
    slot_ids = slot_ids.long().contiguous()
    x, dt, B, C, z = _activations(x, dt, B, C, z)
    return torch.ops.rnnserve.selective_state_update(
        state, slot_ids, x, dt, _f32(dt_bias), _f32(A), B, C, _f32(D), z, dt_softplus
    )


__all__ = ["selective_scan_varlen", "selective_state_update"]
