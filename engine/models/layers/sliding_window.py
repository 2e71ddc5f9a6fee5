"""Sliding-window softmax attention whose state is a per-slot ring buffer of the keys and values before the
current token.

Each query attends to the ``window`` most recent positions of its sequence, its own included. A slot keeps,
per attention layer, the ``window - 1`` keys and values before the next token ``[window - 1, n_kv_heads,
head_dim]`` (after RoPE, in the pool's dtype): position ``p`` lives in row ``p % (window - 1)``, so the state
never grows. Queries have ``n_heads`` heads sharing the key/value heads in groups (multi-query / grouped-query
attention). The work is :mod:`rnnserve.kernels.sliding_window` (Triton on CUDA: a varlen prefill and a fused
decode step over the ring); scores and softmax are fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rnnserve.engine.models.base import PrefillBatch, StateSpec, long_tensor
from rnnserve.kernels.sliding_window import sliding_window_decode, sliding_window_prefill


@dataclass(frozen=True)
class SlidingWindowAttention:
    """The attention of one layer shape: ``q [N, n_heads, head_dim]``, ``k, v [N, n_kv_heads, head_dim]``."""

    n_heads: int
    n_kv_heads: int
    head_dim: int
    window: int

    def __post_init__(self) -> None:
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}")
        if self.window < 2:
            raise ValueError(f"window must be at least 2, got {self.window}")

    @property
    def ring(self) -> int:
        """Rows of the ring: the keys before the current token that a query still sees."""
        return self.window - 1

    def state_specs(self, num_layers: int, dtype: torch.dtype = torch.float32) -> list[StateSpec]:
        """The ring buffers ``k`` and ``v`` of ``num_layers`` layers of this shape."""
        shape = (num_layers, self.ring, self.n_kv_heads, self.head_dim)
        return [StateSpec("k", shape, dtype, 0.0), StateSpec("v", shape, dtype, 0.0)]

    def prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        batch: PrefillBatch,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        """Packed chunks of ``batch`` (rows as ``batch.input_ids``), each continuing its sequence's ring buffer.

        ``k_cache, v_cache [B, window - 1, n_kv_heads, head_dim]`` are the sequences' rings, updated in place
        with the chunk's last keys and values. Returns fp32 ``[T, n_heads * head_dim]``.
        """
        starts = long_tensor(batch.starts, q.device)
        out = sliding_window_prefill(q, k, v, batch.cu_seqlens, starts, k_cache, v_cache, self.head_dim**-0.5)
        return out.reshape(q.shape[0], self.n_heads * self.head_dim)

    def decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        slot_ids: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
    ) -> torch.Tensor:
        """One token per sequence at ``positions [B]``: attend over the rings of rows ``slot_ids`` of ``k_pool,
        v_pool [slots, window - 1, n_kv_heads, head_dim]`` and the token itself, then store its key and value
        in the ring (in place). Returns fp32 ``[B, n_heads * head_dim]``; no host synchronisation (CUDA-graph
        capturable)."""
        out = sliding_window_decode(q, k, v, positions, k_pool, v_pool, slot_ids, self.head_dim**-0.5)
        return out.reshape(q.shape[0], self.n_heads * self.head_dim)
