"""Triton varlen prefill for ``h_t = a_t * h_{t-1} + b_t``: a chunked parallel scan.

One program owns one sequence and ``BD`` channels. It walks the sequence in chunks of ``BT`` steps, scans
each chunk with ``tl.associative_scan`` over the pair ``(a, b)`` (the affine maps ``h -> a h + b`` compose
associatively) and applies the composed map to the state carried from the previous chunk. The log-space
variant scans ``(log a, log b)`` with ``logaddexp``; padding uses the identity ``(0, -inf)`` (``(1, 0)`` in
linear space), so the last row of a chunk always holds the carry. Accumulates in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _logaddexp(x, y):
    """``log(e^x + e^y)``, shifted by the larger operand unless it is infinite: ``-inf`` (both terms 0) gives
    ``-inf`` and ``+inf`` gives ``+inf`` (a shift by ``+inf`` made it ``inf - inf`` = NaN, where the linear-space
    recurrence ``a h + b`` with ``b = inf`` or ``h = inf`` gives inf)."""
    top = tl.maximum(x, y)
    shift = tl.where(tl.abs(top) == float("inf"), 0.0, top)
    return shift + tl.log(tl.exp(x - shift) + tl.exp(y - shift))


@triton.jit
def _compose_linear(a_first, b_first, a_next, b_next):
    return a_first * a_next, a_next * b_first + b_next


@triton.jit
def _compose_log(la_first, lb_first, la_next, lb_next):
    return la_first + la_next, _logaddexp(lb_first + la_next, lb_next)


@triton.jit
def _diag_scan_varlen_kernel(
    a_ptr, b_ptr, h_ptr, h0_ptr, ht_ptr, cu_seqlens_ptr, dim, stride_h0,
    LOG_SPACE: tl.constexpr, HAS_H0: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
):
    i_b = tl.program_id(0)
    i_d = tl.program_id(1)
    bos = tl.load(cu_seqlens_ptr + i_b).to(tl.int64)
    eos = tl.load(cu_seqlens_ptr + i_b + 1).to(tl.int64)
    offs_d = i_d * BD + tl.arange(0, BD)
    mask_d = offs_d < dim
    offs_t = tl.arange(0, BT)
    is_last_row = (offs_t == BT - 1)[:, None]
    if HAS_H0:
        carry = tl.load(h0_ptr + i_b * stride_h0 + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    else:
        carry = tl.zeros([BD], dtype=tl.float32)
    if LOG_SPACE:
        carry = tl.log(carry)
    for start in range(bos, eos, BT):
        rows = start + offs_t
        mask = (rows < eos)[:, None] & mask_d[None, :]
        offsets = rows[:, None] * dim + offs_d[None, :]
        if LOG_SPACE:
            la = tl.load(a_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            lb = tl.load(b_ptr + offsets, mask=mask, other=float("-inf")).to(tl.float32)
            la, lb = tl.associative_scan((la, lb), axis=0, combine_fn=_compose_log)
            out = _logaddexp(la + carry[None, :], lb)
            tl.store(h_ptr + offsets, tl.exp(out), mask=mask)
        else:
            a = tl.load(a_ptr + offsets, mask=mask, other=1.0).to(tl.float32)
            b = tl.load(b_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            a, b = tl.associative_scan((a, b), axis=0, combine_fn=_compose_linear)
            out = a * carry[None, :] + b
            tl.store(h_ptr + offsets, out, mask=mask)
        carry = tl.sum(tl.where(is_last_row, out, 0.0), axis=0)
    if LOG_SPACE:
        carry = tl.exp(carry)
    tl.store(ht_ptr + i_b * dim + offs_d, carry, mask=mask_d)


def diag_scan_varlen_triton(
    a: torch.Tensor,
    b: torch.Tensor,
    cu_seqlens: torch.Tensor,
    initial_state: torch.Tensor | None,
    log_space: bool,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed ``a, b [T, D]`` (log-space when ``log_space``) -> ``(h [T, D], final_state [B, D])`` in fp32.

    ``chunk_size`` (a power of two) bounds the steps scanned in parallel per chunk, at most 32 here: the
    pairwise scan stays stable at any length, so unlike the reference's Heinsen chunks it only sets the tile.
    """
    if chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two, got {chunk_size}")
    total, dim = a.shape
    batch = cu_seqlens.numel() - 1
    a, b = a.contiguous(), b.contiguous()
    h = torch.empty(total, dim, dtype=torch.float32, device=a.device)
    final_state = torch.empty(batch, dim, dtype=torch.float32, device=a.device)
    if initial_state is not None and initial_state.stride(-1) != 1:
        initial_state = initial_state.contiguous()
    # 32 x 32 tiles keep the log-space scan under ~64 registers per thread on sm_90 (64 x 64 spills).
    block_t = min(chunk_size, 32)
    block_d = min(triton.next_power_of_2(dim), 32)
    grid = (batch, triton.cdiv(dim, block_d))
    _diag_scan_varlen_kernel[grid](
        a, b, h, initial_state if initial_state is not None else final_state, final_state, cu_seqlens, dim,
        initial_state.stride(0) if initial_state is not None else 0,
        LOG_SPACE=log_space, HAS_H0=initial_state is not None, BT=block_t, BD=block_d,
    )
    return h, final_state
