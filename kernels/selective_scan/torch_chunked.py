"""Varlen selective-scan prefill in PyTorch, organised for CPUs: the path when the C++ kernel does not apply.

The packed tokens are reordered time-major: sequences sorted by length (longest first), so the sequences
still running at step ``t`` are always a prefix of that order. Per chunk of ``chunk_size`` steps the
discretised ``exp(dt A)`` and ``dt B x`` are computed for all chunk tokens at once; the recurrence then costs
one fused ``addcmul`` per step over the running prefix (no padding, no per-step gathers), and the outputs
``C . h`` of the whole chunk come from one batched matmul.
"""

from __future__ import annotations

import torch

from rnnserve.kernels.selective_scan.naive import discretise, gate_output


def time_major_order(cu_seqlens: torch.Tensor) -> tuple[list[int], torch.Tensor, list[int]]:
    """Sequences by decreasing length, and the packed row of every (step, running sequence) pair.

    Returns ``(active [max_len], rows [T], order [B])``: ``active[t]`` sequences run at step ``t``; ``rows``
    lists their packed token rows step by step; ``order`` maps sorted position to sequence index.
    """
    starts = cu_seqlens[:-1].tolist()
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    order = sorted(range(len(lengths)), key=lambda b: -lengths[b])
    max_len = lengths[order[0]] if order else 0
    sorted_lengths = torch.tensor([lengths[b] for b in order])
    steps = torch.arange(max_len)
    active = (sorted_lengths[None, :] > steps[:, None]).sum(1).tolist()
    sorted_starts = torch.tensor([starts[b] for b in order], dtype=torch.long)
    rows = torch.cat([sorted_starts[:n] + t for t, n in enumerate(active)]) if active else sorted_starts[:0]
    return active, rows.to(cu_seqlens.device), order


def selective_scan_chunked(
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as :func:`~rnnserve.kernels.selective_scan.naive.selective_scan_ref`."""
    dt = discretise(dt, dt_bias, dt_softplus)
    batch = cu_seqlens.numel() - 1
    d_inner, d_state = A.shape
    active, rows, order = time_major_order(cu_seqlens)
    order_t = torch.tensor(order, dtype=torch.long, device=x.device)
    if initial_state is None:
        h = x.new_zeros(batch, d_inner, d_state, dtype=torch.float32)
    else:
        h = initial_state.float()[order_t]
    final = h.clone()
    A = A.float()
    y_time_major = x.new_empty(x.shape[0], d_inner, dtype=torch.float32)
    offset = 0
    for start in range(0, len(active), chunk_size):
        steps = active[start : start + chunk_size]
        count = sum(steps)
        idx = rows[offset : offset + count]
        delta = dt[idx].float()
        decay = torch.exp(delta[:, :, None] * A)
        states = (delta * x[idx].float())[:, :, None] * B[idx].float()[:, None, :]
        local = 0
        for t, n in enumerate(steps):
            out = states[local : local + n]
            torch.addcmul(out, decay[local : local + n], h[:n], out=out)
            following = active[start + t + 1] if start + t + 1 < len(active) else 0
            if following < n:
                final[following:n] = out[following:]
            h = out
            local += n
        y_time_major[offset : offset + count] = torch.bmm(states, C[idx].float()[:, :, None])[:, :, 0]
        offset += count
    y = torch.empty_like(y_time_major)
    y[rows] = y_time_major
    final_state = torch.empty_like(final)
    final_state[order_t] = final
    return gate_output(y, x, D, z), final_state
