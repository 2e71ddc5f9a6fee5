"""Sliding-window softmax attention whose state is a per-slot ring buffer of the last ``window`` keys and values.

Each query attends to the ``window`` most recent positions of its sequence, its own included. A slot keeps,
per attention layer, keys and values ``[window, n_kv_heads, head_dim]`` (after RoPE, in the pool's dtype):
position ``p`` lives in row ``p % window``, so the state never grows. Queries have ``n_heads`` heads sharing
the key/value heads in groups (multi-query / grouped-query attention). Scores and softmax are fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rnnserve.engine.models.base import PrefillBatch, StateSpec


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

    def state_specs(self, num_layers: int, dtype: torch.dtype = torch.float32) -> list[StateSpec]:
        """The ring buffers ``k`` and ``v`` of ``num_layers`` layers of this shape."""
        shape = (num_layers, self.window, self.n_kv_heads, self.head_dim)
        return [StateSpec("k", shape, dtype, 0.0), StateSpec("v", shape, dtype, 0.0)]

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``q [B, Lq, H, d]``, ``k, v [B, Lk, Hkv, d]``, ``mask [B, Lq, Lk]`` -> fp32 ``[B, Lq, H * d]``."""
        group = self.n_heads // self.n_kv_heads
        q, k, v = (t.transpose(1, 2).float() for t in (q, k, v))
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = (q @ k.transpose(2, 3)) * self.head_dim**-0.5
        scores = scores.masked_fill(~mask[:, None], float("-inf"))
        out = torch.softmax(scores, dim=-1) @ v
        return out.transpose(1, 2).reshape(q.shape[0], -1, self.n_heads * self.head_dim)

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

        ``k_cache, v_cache [B, window, n_kv_heads, head_dim]`` are the sequences' ring buffers, updated in
        place with the chunk's last ``window`` keys and values. Returns fp32 ``[T, n_heads * head_dim]``.
        """
        window = self.window
        out = q.new_empty(q.shape[0], self.n_heads * self.head_dim, dtype=torch.float32)
        rows = torch.arange(window, device=q.device)
        hi = 0
        for i, (start, length) in enumerate(zip(batch.starts, batch.lengths, strict=True)):
            lo, hi = hi, hi + length
            positions = batch.positions[lo:hi]
            # Ring row r holds the latest position before ``start`` congruent to r (mod window), if any.
            cached = start - 1 - (start - 1 - rows) % window
            keys_pos = torch.cat([cached, positions])[None]
            keys = torch.cat([k_cache[i].to(k.dtype), k[lo:hi]])
            values = torch.cat([v_cache[i].to(v.dtype), v[lo:hi]])
            query_pos = positions[:, None]
            mask = (keys_pos >= 0) & (keys_pos <= query_pos) & (keys_pos > query_pos - window)
            out[lo:hi] = self._attend(q[None, lo:hi], keys[None], values[None], mask[None])[0]
            kept = slice(hi - min(length, window), hi)
            ring_rows = batch.positions[kept] % window
            k_cache[i, ring_rows] = k[kept].to(k_cache.dtype)
            v_cache[i, ring_rows] = v[kept].to(v_cache.dtype)
        return out

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
        """One token per sequence at ``positions [B]``: store its key and value in the ring buffers of rows
        ``slot_ids`` of ``k_pool, v_pool [slots, window, n_kv_heads, head_dim]`` (in place), then attend.

        Returns fp32 ``[B, n_heads * head_dim]``; no host synchronisation (CUDA-graph capturable).
        """
        window = self.window
        ring_rows = positions % window
        k_pool[slot_ids, ring_rows] = k.to(k_pool.dtype)
        v_pool[slot_ids, ring_rows] = v.to(v_pool.dtype)
        mask = (torch.arange(window, device=q.device)[None, :] <= positions[:, None])[:, None, :]
        return self._attend(q[:, None], k_pool[slot_ids], v_pool[slot_ids], mask)[:, 0]
