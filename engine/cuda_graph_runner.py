"""CUDA-graph decode: the whole decode step (all layers and the LM head) captured once per batch-size bucket.

At start-up :meth:`CUDAGraphDecodeRunner.capture` records ``model.decode`` on static input buffers for every
bucket (1, 2, 4, ..., 256, then multiples of 256, up to ``max_num_seqs``). A decode batch is padded to its
bucket; the padding rows point at the state pool's scratch slot, so they never touch a real sequence's
state. Graphs bake in the addresses of the weights and the state pool: neither may be reallocated after
capture. ``--enforce-eager`` skips this runner.
"""

from __future__ import annotations

import bisect
import logging
import time

import torch

from rnnserve.engine.models.base import DecodeBatch, RecurrentLM, StateTensors

logger = logging.getLogger(__name__)

SMALL_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
LARGE_BUCKET_STEP = 256


def bucket_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture: powers of two up to 256, then multiples of 256, ending at ``max_num_seqs``."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes = [b for b in SMALL_BUCKETS if b < max_num_seqs]
    sizes += range(2 * LARGE_BUCKET_STEP, max_num_seqs, LARGE_BUCKET_STEP)
    return [*sizes, max_num_seqs]


class CUDAGraphDecodeRunner:
    """Replays a captured ``model.decode`` for batches of up to ``max_batch_size`` sequences."""

    def __init__(
        self, model: RecurrentLM, state: StateTensors, scratch_slot: int, max_batch_size: int
    ) -> None:
        device = next(iter(state.values())).device
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need the state pool on a CUDA device, not {device}")
        self.model = model
        self.state = state
        self.scratch_slot = scratch_slot
        self.buckets = bucket_sizes(max_batch_size)
        self.input_ids = torch.zeros(max_batch_size, dtype=torch.long, device=device)
        self.slot_ids = torch.full((max_batch_size,), scratch_slot, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_batch_size, dtype=torch.long, device=device)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._logits: dict[int, torch.Tensor] = {}

    @property
    def max_batch_size(self) -> int:
        return self.buckets[-1]

    def bucket_for(self, batch: int) -> int:
        """The smallest captured batch size that holds ``batch`` rows."""
        if not 1 <= batch <= self.max_batch_size:
            raise ValueError(f"decode batch of {batch} outside 1..{self.max_batch_size}")
        return self.buckets[bisect.bisect_left(self.buckets, batch)]

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture one graph per bucket (largest first, sharing one memory pool); logs time and memory."""
        torch.cuda.synchronize()
        start = time.perf_counter()
        free_before, _ = torch.cuda.mem_get_info()
        self.input_ids.zero_()
        self.slot_ids.fill_(self.scratch_slot)
        self.positions.zero_()
        # Warm-up on a side stream compiles the Triton kernels and sets up cuBLAS; it writes only the scratch slot.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for bucket in self.buckets:
                self.model.decode(self._static_batch(bucket), self.state)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        pool = None
        for bucket in reversed(self.buckets):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._logits[bucket] = self.model.decode(self._static_batch(bucket), self.state)
            pool = graph.pool() if pool is None else pool
            self._graphs[bucket] = graph
        torch.cuda.synchronize()
        free_after, _ = torch.cuda.mem_get_info()
        logger.info(
            "captured %d CUDA decode graphs (batch sizes %s) in %.2f s using %.1f MiB of GPU memory",
            len(self._graphs), self.buckets, time.perf_counter() - start, (free_before - free_after) / 2**20,
        )

    def _static_batch(self, size: int) -> DecodeBatch:
        return DecodeBatch(self.input_ids[:size], self.slot_ids[:size], self.positions[:size])

    @torch.inference_mode()
    def __call__(self, decode: DecodeBatch) -> torch.Tensor:
        """Decode one token for each of ``B`` sequences; returns their logits ``[B, V]``.

        The result is a view of the graph's static output buffer: it is overwritten by the next call.
        """
        if not self._graphs:
            raise RuntimeError("call capture() before decoding")
        batch = decode.input_ids.shape[0]
        bucket = self.bucket_for(batch)
        self.input_ids[:batch].copy_(decode.input_ids, non_blocking=True)
        self.slot_ids[:batch].copy_(decode.slot_ids, non_blocking=True)
        self.positions[:batch].copy_(decode.positions, non_blocking=True)
        if bucket > batch:
            self.slot_ids[batch:bucket].fill_(self.scratch_slot)
        self._graphs[bucket].replay()
        return self._logits[bucket][:batch]
