"""Chunked SSD prefill over packed variable-length batches in PyTorch (Mamba-2's "state space duality" algorithm).

Every sequence is cut into chunks of ``chunk_size`` tokens (chunks never straddle sequences) and the chunks
of the whole batch are processed together:

1. within a chunk, outputs are a masked "attention" ``(C_l . B_s) * exp(cumA_l - cumA_s) * dt_s x_s``;
2. each chunk's own end state ``sum_s exp(cumA_end - cumA_s) dt_s x_s B_s``;
3. a short sequential pass over chunk positions carries states between a sequence's chunks;
4. each chunk's incoming state contributes ``exp(cumA_l) C_l . S_in``.

Padding positions inside the last chunk of a sequence get ``dt = 0``: no decay, no input, so they leave
the state unchanged. Everything but step 3 is a handful of batched matmuls.
"""

from __future__ import annotations

import torch


def _chunk_layout(
    cu_seqlens: torch.Tensor, chunk_size: int, pad_row: int
) -> tuple[torch.Tensor, list[list[int]]]:
    """Token rows of every chunk ``[num_chunks, chunk_size]`` (``pad_row`` past the end) and, per
    sequence, its chunk ids in order."""
    bounds = cu_seqlens.tolist()
    starts, ends, per_seq = [], [], []
    for b in range(len(bounds) - 1):
        ids = []
        for s in range(bounds[b], bounds[b + 1], chunk_size):
            ids.append(len(starts))
            starts.append(s)
            ends.append(min(s + chunk_size, bounds[b + 1]))
        per_seq.append(ids)
    offsets = torch.arange(chunk_size)
    rows = torch.tensor(starts, dtype=torch.long)[:, None] + offsets
    rows = torch.where(rows < torch.tensor(ends, dtype=torch.long)[:, None], rows, pad_row)
    return rows.to(cu_seqlens.device), per_seq


def ssd_scan_chunked(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    cu_seqlens: torch.Tensor,
    D: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as :func:`~rnnserve.kernels.ssd.naive.ssd_scan_ref`.

    ``B`` and ``C`` stay per group (``[..., G, N]``): the heads of a group share ``C_l . B_s`` and the products
    with ``B`` and ``C``, which take the group's heads as one wider matrix (heads split as ``[G, H / G]``)."""
    total, heads, head_dim = x.shape
    batch = cu_seqlens.numel() - 1
    groups, d_state = B.shape[-2], B.shape[-1]
    per_group = heads // groups
    rows, per_seq = _chunk_layout(cu_seqlens, chunk_size, pad_row=total)

    def chunked(t: torch.Tensor) -> torch.Tensor:
        padded = torch.cat([t.float(), t.new_zeros((1, *t.shape[1:]), dtype=torch.float32)])
        return padded[rows]

    num_chunks = rows.shape[0]
    dt_c = chunked(dt)  # [c, l, h]
    xdt = (chunked(x) * dt_c[..., None]).view(num_chunks, chunk_size, groups, per_group, head_dim)  # [c, l, g, j, p]
    log_decay = torch.cumsum(dt_c * A.float(), dim=1)  # [c, l, h]
    decay = log_decay.view(num_chunks, chunk_size, groups, per_group)  # [c, l, g, j]
    Bc, Cc = chunked(B), chunked(C)  # [c, l, g, n]

    # 1. intra-chunk outputs
    seg = decay.permute(0, 2, 3, 1)[..., :, None] - decay.permute(0, 2, 3, 1)[..., None, :]  # [c, g, j, l, s]
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=x.device).tril()
    scores = torch.einsum("clgn,csgn->cgls", Cc, Bc)[:, :, None]  # [c, g, 1, l, s]
    weights = torch.exp(seg.masked_fill(~causal, float("-inf"))) * scores
    y = torch.einsum("cgjls,csgjp->clgjp", weights, xdt)

    # 2. each chunk's end state from its own inputs
    to_end = torch.exp(decay[:, -1:] - decay)  # [c, l, g, j]
    chunk_states = torch.einsum("clgn,clgjp->cgjpn", Bc, xdt * to_end[..., None])
    chunk_states = chunk_states.reshape(num_chunks, heads, head_dim, d_state)

    # 3. carry states across each sequence's chunks
    chunk_decay = torch.exp(log_decay[:, -1, :])[:, :, None, None]  # [c, h, 1, 1]
    state = (
        x.new_zeros(batch, heads, head_dim, d_state, dtype=torch.float32)
        if initial_state is None
        else initial_state.float().clone()
    )
    incoming = torch.empty_like(chunk_states)
    for position in range(max(map(len, per_seq), default=0)):
        seqs = [b for b, ids in enumerate(per_seq) if position < len(ids)]
        ids = torch.tensor([per_seq[b][position] for b in seqs], device=x.device)
        seq_index = torch.tensor(seqs, device=x.device)
        incoming[ids] = state[seq_index]
        state[seq_index] = chunk_decay[ids] * state[seq_index] + chunk_states[ids]

    # 4. contribution of the incoming state
    incoming = incoming.view(num_chunks, groups, per_group, head_dim, d_state)
    y = y + torch.einsum("clgn,cgjpn->clgjp", Cc, incoming) * torch.exp(decay)[..., None]

    out = x.new_empty((total + 1, heads, head_dim), dtype=torch.float32)
    out[rows.flatten()] = y.reshape(-1, heads, head_dim)
    out = out[:total]
    if D is not None:
        out = out + D.float()[:, None] * x.float()
    return out, state
